"""Qwen2.5-VL-7B's vision tower over one caption step's images (58 of 448 x 448: 59,392 patches), random
weights in bf16: the tower as built in plain PyTorch (its MLP 3420 wide, torch's RMSNorm and RoPE)
against the tower as loading leaves it (gate and up fused and padded to 3424, SwiGLU.after_load_) with
the RMSNorm and rotary kernels. Both outputs are checked against each other first. Then the MLP's two
GEMMs alone at four widths (session U's probe: the down projection at width 3420 took 2,838 us on an
H100 at 65,536 rows, 861 at 3424). Prints two tables and one JSON line.

    PYTHONPATH=. python3 bench/vision_tower_gpu.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from overnight.bench.gpu_info import sm_clock_now
from overnight.kernels import dispatch
from overnight.models.interface import finish_loading
from overnight.models.registry import arch_from_hf_config
from overnight.models.vision.qwen_vit import build_vision_tower

PRESET = Path(__file__).resolve().parents[1] / "overnight/loader/presets/qwen2.5-vl-7b.json"
DEV, DT = torch.device("cuda"), torch.bfloat16
IMAGES, SIDE = 58, 32  # 448 / 14 patches a side
REPEATS = 5
GEMM_ROWS, WIDTHS = 65_536, (3420, 3424, 3456, 3584)  # the probe: patches of a step, MLP widths


def timed(call, repeats: int) -> float:
    """Milliseconds a call, after one untimed call."""
    call()
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main(vision_config: dict | None = None) -> None:
    config = json.loads(PRESET.read_text())
    if vision_config is not None:
        config["vision_config"] = vision_config
    v = arch_from_hf_config(config).vision
    assert v is not None
    torch.manual_seed(0)
    tower = build_vision_tower(v).to(DEV, DT).eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0.0, 0.02)
    grid = [(1, SIDE, SIDE)] * IMAGES
    width = v.in_channels * v.temporal_patch_size * v.patch_size**2
    pixels = torch.randn(IMAGES * SIDE * SIDE, width, device=DEV, dtype=DT)
    rows = []
    with torch.no_grad():
        dispatch.FORCE_KERNELS = False
        built = tower(pixels, grid).embeds
        rows.append(
            ("as built: torch norm and RoPE, MLP unpadded", timed(lambda: tower(pixels, grid), REPEATS))
        )
        dispatch.FORCE_KERNELS = None if DEV.type == "cuda" else True
        finish_loading(tower)
        fast = tower(pixels, grid).embeds
        rows.append(("loaded: kernels, MLP fused and padded", timed(lambda: tower(pixels, grid), REPEATS)))
        dispatch.FORCE_KERNELS = None
    err = ((fast.float() - built.float()).norm() / built.float().norm()).item()
    ok = err < 2e-2
    print(f"SM clock (now, max): {sm_clock_now()}")
    print(f"tower of {v.kind}, {IMAGES} images of {SIDE} x {SIDE} patches; relative error {err:.2e}")
    print("| tower | ms | images/s |\n|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} | {IMAGES / ms * 1e3:.0f} |")
    gemms = gemm_widths(v.hidden_size)
    print("| MLP width | gate and up (one GEMM), us | down, us |\n|---|---|---|")
    for width, (up_us, down_us) in gemms.items():
        print(f"| {width} | {up_us:.0f} | {down_us:.0f} |")
    print(json.dumps({"bench": "vision_tower", "ok": ok, "rel_err": err, "ms": [ms for _, ms in rows],
                      "gemm_us": gemms}))  # fmt: skip


def gemm_widths(hidden: int) -> dict[int, tuple[float, float]]:
    """{width: (us of x @ [gate | up]^T, us of h @ down^T)} at GEMM_ROWS rows of the tower's width."""
    out = {}
    x = torch.randn(GEMM_ROWS, hidden, device=DEV, dtype=DT)
    for width in WIDTHS:
        gate_up = torch.randn(2 * width, hidden, device=DEV, dtype=DT)
        h = torch.randn(GEMM_ROWS, width, device=DEV, dtype=DT)
        down = torch.randn(hidden, width, device=DEV, dtype=DT)
        up_ms = timed(lambda w=gate_up: x @ w.t(), 4 * REPEATS)
        down_ms = timed(lambda a=h, w=down: a @ w.t(), 4 * REPEATS)
        out[width] = (up_ms * 1e3, down_ms * 1e3)
    return out


if __name__ == "__main__":
    main()
