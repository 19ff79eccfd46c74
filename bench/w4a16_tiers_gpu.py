"""W4A16's decode-batch tiers chosen on the GPU and tried end to end in one call (~7 minutes).

Run on a GPU from the repository root:  PYTHONPATH=. python3 bench/w4a16_tiers_gpu.py
                                        [--model qwen3-32b-awq] [--num-prompts 512] [--save FILE]
                                        [--no-runs]  (steps 1-2 only)

1. bench/w4a16_variants_gpu.py's --mid section: every swapped fused tile against the default
   (dequantize + cuBLAS) at 96-384 rows and Qwen3-32B's shapes, checked against the reference first.
2. From its geometric means: the winner at each M, and the tiers that use the winners from 128 rows up
   to the last M in a row where a fused tile beat the default (DEQUANT_GEMM_MIN_M just past it).
   Rows below DEQUANT_GEMM_MIN_M (96) compare the tiles with the current fused tier there.
3. Ours on the model (seed-512-256, dummy weights, `--int-weights packed`) twice, each in its own
   process: the current tiers, then the new ones. Prints both JSON lines and the ratio: what putting
   the new tiers into kernels/w4a16_gemm.py would gain.

`--save FILE` writes the new tiers' JSON there (bench/pairs_gpu.sh's OV_W4A16_TIERS runs ours with them).
`--apply TIERS_JSON -- ARGS` (used by step 3): set the tiers, then run `overnight ARGS` in this process
(TIERS_JSON: [tiers, DEQUANT_GEMM_MIN_M] on words in column order, or with a third item, MMA_ORDER:
then the threshold is MMA_DEQUANT_GEMM_MIN_M).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict

sys.path.insert(0, ".")

import bench.w4a16_variants_gpu as vb  # noqa: E402
from overnight.kernels import w4a16_gemm  # noqa: E402
from overnight.kernels.w4a16_gemm import W4A16Config  # noqa: E402

RUN_TIMEOUT_S = 240


def winners(table: list[dict], variants: dict, ms: tuple[int, ...], shapes: int) -> dict[int, str]:
    """Per M, the variant with the best geometric mean of x bf16 over the shapes (run at all of them)."""
    best = {}
    for m in ms:
        means = vb.geometric_means(table, m, variants, shapes)
        if means:
            best[m] = max(means, key=lambda n: means[n])
    return best


def new_tiers(
    best: dict[int, str], variants: dict, mma_order: bool = False
) -> tuple[list[tuple[int, dict]], int] | None:
    """(tiers as (bound, W4A16Config fields), the dequantize threshold) using the fused winners up to
    the first M where the default wins and is dequantize + cuBLAS; None when no other variant wins
    before that. Below the threshold (MMA_DEQUANT_GEMM_MIN_M for words in MMA order) the default is a
    fused tier: where it wins after a fused winner, its tier at that M is kept in the middle."""
    min_m = w4a16_gemm.MMA_DEQUANT_GEMM_MIN_M if mma_order else w4a16_gemm.DEQUANT_GEMM_MIN_M
    fused: list[tuple[int, W4A16Config]] = []
    for m in sorted(best):
        if best[m] == "default":
            if m >= min_m:
                break
            if fused:  # the tiers kept below the first fused winner already cover the earlier ones
                fused.append((m, w4a16_gemm.default_config(m, mma_order)))
            continue
        fused.append((m, variants[best[m]](m)))
    if not fused:
        return None
    first, last = fused[0][0], fused[-1][0]
    keep_low = [(b, c) for b, c in w4a16_gemm.TIERS if b < first]
    keep_high = [(b, c) for b, c in w4a16_gemm.TIERS if b > last]
    tiers = keep_low + fused + keep_high
    return [(b, asdict(c)) for b, c in tiers], last + 1


def apply(spec: str) -> None:
    """Set the tiers from [tiers, DEQUANT_GEMM_MIN_M] (words in column order, as this bench times
    them) or [tiers, threshold, MMA_ORDER] (bench/w4a16_mma_gpu.py's plan: the threshold is
    MMA_DEQUANT_GEMM_MIN_M when MMA_ORDER is on)."""
    tiers, min_m, *mma = json.loads(spec)
    w4a16_gemm.TIERS = tuple((b, W4A16Config(**c)) for b, c in tiers)
    w4a16_gemm.MMA_ORDER = bool(mma and mma[0])
    if w4a16_gemm.MMA_ORDER:
        w4a16_gemm.MMA_DEQUANT_GEMM_MIN_M = min_m
    else:
        w4a16_gemm.DEQUANT_GEMM_MIN_M = min_m


def ours(args: list[str], spec: str | None) -> dict | None:
    cmd = [sys.executable, "-m", "overnight", *args]
    if spec is not None:
        cmd = [sys.executable, __file__, "--apply", spec, "--", *args]
    env = {**os.environ, "PYTHONPATH": "."}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        print(f"timed out after {RUN_TIMEOUT_S} s", flush=True)
        return None
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode or not lines:
        print(f"rc={p.returncode}\n{(p.stdout + p.stderr)[-2000:]}", flush=True)
        return None
    return json.loads(lines[-1])


def main(argv: list[str]) -> None:
    model = argv[argv.index("--model") + 1] if "--model" in argv else "qwen3-32b-awq"
    prompts = argv[argv.index("--num-prompts") + 1] if "--num-prompts" in argv else "512"
    import torch

    print(torch.cuda.get_device_name(), flush=True)
    t0 = time.time()
    vb.SHAPES, vb.MS, vb.CHECK_MS, vb.W4A16_VARIANTS = (
        vb.MID_SHAPES,
        vb.MID_MS,
        vb.MID_CHECK_MS,
        vb.MID_VARIANTS,
    )
    vb.correctness(True)
    vb.times(True)
    if vb.RESULTS.get("correctness") != "ok" or not isinstance(vb.RESULTS.get("times"), list):
        print(f"the variants failed their check or their timing: {vb.RESULTS.get('correctness')}")
        return
    best = winners(vb.RESULTS["times"], vb.MID_VARIANTS, vb.MID_MS, len(vb.MID_SHAPES))
    print(f"\nwinners by M: {best}  ({time.time() - t0:.0f} s)", flush=True)
    planned = new_tiers(best, vb.MID_VARIANTS)
    if planned is None:
        print("the default (dequantize + cuBLAS) wins at the smallest M: the tiers stay")
        return
    spec = json.dumps(planned)
    print(f"new tiers (bound, config), DEQUANT_GEMM_MIN_M: {spec}", flush=True)
    if "--save" in argv:  # for bench/pairs_gpu.sh's OV_W4A16_TIERS
        with open(argv[argv.index("--save") + 1], "w") as f:
            f.write(spec)
    if "--no-runs" in argv:  # the tiles and the plan only (the pair then runs ours with them)
        return
    args = ["bench", "throughput", "--model", model, "--workload", "seed-512-256", "--num-prompts", prompts]
    args += ["--load-format", "dummy", "--int-weights", "packed"]
    before = ours(args, None)
    after = ours(args, spec)
    for tag, r in (("current tiers", before), ("new tiers", after)):
        print(f"{tag}: {json.dumps(r and r['results'][0])}")
    if before and after:
        a, b = after["results"][0]["output_tok_s"], before["results"][0]["output_tok_s"]
        print(f"output tok/s: current {b:,.1f}, new {a:,.1f}: new / current {a / b:.3f}x")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--apply"]:
        apply(sys.argv[2])
        from overnight.cli import main as overnight_main

        sys.exit(overnight_main(sys.argv[sys.argv.index("--") + 1 :]))
    main(sys.argv[1:])
