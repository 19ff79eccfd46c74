"""The LoRA kernels at Qwen3-8B's projections (8 adapters of rank 16), timed as the engine runs them:
one layer's four shrinks and four expands captured in a CUDA graph (bench/gpu_timing.py), decode steps
of 256 and 1,024 rows (a graph's grid over every row) and a 4,096-row prefill step, with the 64-row
tiles prefill runs and the 16-row ones it ran before session U. The shrink with K
in one pass (splits 1, how session S's kernels ran) beside the split chosen by shrink_splits; each
expand with 64, 128 and 256 output columns a program (EXPAND_BLOCK_N). Each checked against the torch
reference first. Prints a table and one JSON line.

    PYTHONPATH=. python3 bench/lora_gpu.py
"""

from __future__ import annotations

import json

import torch

from bench.gpu_timing import graph_time
from overnight.bench.gpu_info import sm_clock_now
from overnight.kernels import lora
from overnight.kernels.lora import (
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
    shrink_splits,
    slot_rows_ref,
)

HIDDEN, INTER, Q, KV = 4096, 12288, 4096, 1024
# (name, input width, slices): the layer's four wrapped projections
PROJECTIONS = [("qkv", HIDDEN, (Q, KV, KV)), ("o", Q, (HIDDEN,)), ("gate_up", HIDDEN, (INTER, INTER)),
               ("down", INTER, (HIDDEN,))]  # fmt: skip
SLOTS, RANK, LAYERS = 8, 16, 36
DEV, DT = torch.device("cuda"), torch.bfloat16
# (step, rows, decode grid, rows a tile): prefill with the 64-row tiles it runs and the 16-row ones it ran;
# decode with 32- and 64-row tiles too, at 256, 512 and 1,024 rows (session V: at 1,024 rows 64-row tiles
# took the step's LoRA from 7.20 to 5.79 ms; the smaller batches say whether a decode graph's tile should
# grow with its bucket)
CASES = (("decode", 256, True, 16), ("decode", 256, True, 32), ("decode", 256, True, 64),
         ("decode", 512, True, 16), ("decode", 512, True, 64), ("decode", 1024, True, 16),
         ("decode", 1024, True, 32), ("decode", 1024, True, 64), ("prefill", 4096, False, 64),
         ("prefill", 4096, False, 16))  # fmt: skip
EXPAND_COLUMNS = (64, 128, 256)


def case(
    num_rows: int, decode: bool, block_m: int, splits: int | None, seed: int = 0
) -> tuple[float, float, bool]:
    """(shrink us, expand us) for one layer's four projections, and whether h and y matched the
    references."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    token_slots = torch.arange(num_rows, device=DEV, dtype=torch.int32) % (SLOTS + 1) - 1  # 1/9 base rows
    rows = slot_rows_ref(token_slots, SLOTS, padded=decode, block_m=block_m)
    shrinks, expands, ok = [], [], True
    for _, k, slices in PROJECTIONS:
        x = torch.randn(num_rows, k, device=DEV, generator=gen, dtype=DT)
        a = 0.02 * torch.randn(SLOTS, len(slices), RANK, k, device=DEV, generator=gen, dtype=DT)
        b = 0.02 * torch.randn(SLOTS, sum(slices), RANK, device=DEV, generator=gen, dtype=DT)
        y = torch.zeros(num_rows, sum(slices), device=DEV, dtype=DT)
        offs = [0]
        for s in slices:
            offs.append(offs[-1] + s)
        offsets = torch.tensor(offs, dtype=torch.int32, device=DEV)
        h = lora_shrink(x, a, rows, zero_base_rows=False, splits=splits)
        ref = lora_shrink_ref(x, a, token_slots)
        adapted = token_slots >= 0
        ok &= bool(torch.allclose(h[adapted], ref[adapted], atol=2e-2, rtol=2e-2))
        y_ref = y.clone()
        lora_expand_ref(y_ref, ref, b, token_slots, tuple(offs))
        lora_expand(y, ref, b, offsets, max(slices), rows)
        ok &= bool(torch.allclose(y, y_ref, atol=2e-2, rtol=2e-2))
        shrinks.append(lambda x=x, a=a: lora_shrink(x, a, rows, zero_base_rows=False, splits=splits))
        expands.append(lambda y=y, h=h, b=b, o=offsets, m=max(slices): lora_expand(y, h, b, o, m, rows))
    return graph_time(shrinks) * len(shrinks), graph_time(expands) * len(expands), ok


def main() -> None:
    gpu = torch.cuda.get_device_name() if DEV.type == "cuda" else str(DEV)
    print(f"{gpu}, SM clock (now, max): {sm_clock_now()}")
    head = ["step", "rows", "rows a tile", "shrink splits (qkv, o, gate_up, down)", "expand columns"]
    head += ["shrink us/layer"]
    head += ["expand us/layer", "per step, 36 layers (ms)", "check"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    out = []
    default_n = lora.EXPAND_BLOCK_N
    for label, num_rows, decode, block_m in CASES:
        for mode, block_n in (("one pass", default_n), *(("split", n) for n in EXPAND_COLUMNS)):
            lora.EXPAND_BLOCK_N = block_n
            splits = 1 if mode == "one pass" else None
            s_us, e_us, ok = case(num_rows, decode, block_m, splits)
            # the fused slices fold into one dot: one program column a split
            chosen = [shrink_splits(k, num_rows, 1, block_m)[0] for _, k, _ in PROJECTIONS]
            chosen = [1] * len(chosen) if splits == 1 else chosen
            ms = (s_us + e_us) * LAYERS / 1e3
            cells = [label, num_rows, block_m, f"{mode} {chosen}", block_n, f"{s_us:.1f}", f"{e_us:.1f}"]
            cells.append(f"{ms:.2f}")
            print("| " + " | ".join(map(str, cells)) + f" | {'ok' if ok else 'FAIL'} |")
            out.append(dict(step=label, rows=num_rows, block_m=block_m, mode=mode, splits=chosen,
                            expand_block_n=block_n, shrink_us=round(s_us, 1), expand_us=round(e_us, 1),
                            step_ms=round(ms, 2), ok=ok))  # fmt: skip
    lora.EXPAND_BLOCK_N = default_n
    print(json.dumps({"bench": "lora_gpu", "gpu": gpu, "sm_clock": sm_clock_now(), "cases": out}))


if __name__ == "__main__":
    main()
