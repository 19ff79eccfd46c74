"""FP8 weights on the GPU: kernel correctness, GEMM and fused-op timings, and accuracy on a random Qwen3-0.6B.

Run on the H200 from the repository root:  PYTHONPATH=. python bench/fp8_weights_gpu.py
Needs torch + triton; about 2-3 minutes. Fixed seeds. Each section runs even if an earlier one failed.

1. Correctness (bf16 inputs): the quantization kernel, RMSNorm / residual-add + RMSNorm / SiLU-and-mul
   with FP8 outputs (e4m3 codes equal to quantizing the unfused kernel's output; within one code of the
   PyTorch chain), the Triton FP8 GEMM per channel and block-scaled, torch._scaled_mm's row-wise call,
   Fp8Linear against its reference path, and a CUDA-graph replay of norm -> linear -> SiLU -> linear.
2. GEMMs at the Qwen3-8B shapes (qkv 4096->6144, o 4096->4096, gate_up 4096->24576, down 12288->4096)
   x M in {128, 512, 1024, 8192, 16384}: bf16 F.linear; torch._scaled_mm row-wise, alone and with the
   per-token quantization of a bf16 input; the Triton per-channel GEMM; the Triton block-scaled GEMM
   (128 x 128 weight blocks, the Qwen3-*-FP8 layout). Triton: the best of a few tile configs (the
   default's time too). A 128x128-block checkpoint runs either as blocks (Triton) or requantized per
   channel at load (_scaled_mm): their speed is in the table, their error against the checkpoint's own
   dequantized weights in a second table.
3. Fused activation quantization vs the unfused kernels (norm or SiLU, then the quantization kernel).
4. Accuracy: random Qwen3-0.6B (preset qwen3-0.6b, dummy weights re-drawn with unit-gain projections so
   activations keep their size through the 28 layers; the dummy init's +-1e-3 gives near-uniform logits
   where any noise flips the argmax), 64 prompts x 128 greedy tokens from the bf16 engine (CUDA graphs),
   then teacher-forced on those tokens: the FP8 model's top-1 agreement (goal >= 95%) and mean |dlogprob|
   of the bf16 tokens; the same for an fp32 copy of the bf16 model (the noise floor: how much this
   random model moves under bf16's own rounding), and the agreement at "decided" positions (bf16 top-2
   margin >= 1 nat), the regime of a trained model's greedy text.

What to look for: every check "ok"; which GEMM wins per shape and M (the engine uses _scaled_mm for
per-channel layers: overnight/quant/linear.py PER_CHANNEL_GEMM; block checkpoints are requantized per
channel unless quant/scheme.py KEEP_WEIGHT_BLOCKS); the block-vs-requantized errors; the accuracy lines.
"""

from __future__ import annotations

import copy
import gc
import json
import random
import sys
import time
import traceback
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, ".")

from overnight.bench.gpu_info import sm_clock_now  # noqa: E402
from overnight.kernels import dispatch  # noqa: E402
from overnight.kernels.activation import silu_and_mul, silu_and_mul_fp8  # noqa: E402
from overnight.kernels.fp8_gemm import GemmConfig, default_config, fp8_gemm  # noqa: E402
from overnight.kernels.fp8_quant import quantize_fp8  # noqa: E402
from overnight.kernels.rmsnorm import add_rms_norm, add_rms_norm_fp8, rms_norm, rms_norm_fp8  # noqa: E402
from overnight.layers.activation import SiluAndMul, silu_and_mul_ref  # noqa: E402
from overnight.layers.norm import RMSNorm, add_rms_norm_ref, rms_norm_ref  # noqa: E402
from overnight.quant.fp8 import (  # noqa: E402
    QuantizedActivation,
    dequantize_weight,
    expand_block_scales,
    quantize_activation_ref,
    quantize_weight_blocks,
    quantize_weight_per_channel,
    requantize_per_channel,
    scaled_matmul_ref,
)
from overnight.quant.linear import Fp8Linear, scaled_mm_rowwise  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
EPS = 1e-6
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096)]
MS = [128, 512, 1024, 8192, 16384]
CONFIGS = [
    GemmConfig(64, 64, 128, num_warps=4, num_stages=4),
    GemmConfig(64, 128, 128, num_warps=4, num_stages=4),
    GemmConfig(128, 128, 128, num_warps=8, num_stages=4),
    GemmConfig(128, 128, 128, num_warps=4, num_stages=4),
    GemmConfig(128, 256, 128, num_warps=8, num_stages=3),
]
ACCURACY_MODEL, NUM_PROMPTS, NEW_TOKENS = "qwen3-0.6b", 64, 128
checks: list[tuple[str, bool, str]] = []
summary: dict[str, object] = {}


def record(name: str, ok: bool, detail: str = "") -> None:
    checks.append((name, ok, detail))
    print(f"  {'ok  ' if ok else 'FAIL'} {name:<52} {detail}", flush=True)


def section(title: str, fn: Callable[[], None]) -> None:
    print(f"\n== {title} (SM clock {sm_clock_now()})", flush=True)
    start = time.time()
    try:
        fn()
    except Exception as e:  # keep going: one run, no second chance
        traceback.print_exc()
        record(f"{title}: crashed", False, f"{type(e).__name__}: {e}"[:200])
    print(f"   ({time.time() - start:.1f} s)", flush=True)


def randn(*shape: int, scale: float = 1.0, seed: int = 0, dtype: torch.dtype | None = None) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen, device=DEV)).to(dtype or BF16)


def time_us(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def codes(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.uint8).to(torch.int32)
    return torch.where(bits >= 0x80, -(bits & 0x7F), bits & 0x7F)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# -- 1. correctness -------------------------------------------------------------------------------------


def check_codes(
    name: str, data: torch.Tensor, scale: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor], ulps: int = 0
) -> None:
    apart = (codes(data) - codes(ref[0])).abs()
    scale_ok = (
        torch.equal(scale, ref[1]) if ulps == 0 else bool(((scale - ref[1]).abs() <= 1e-6 * ref[1]).all())
    )
    differ = int((apart > 0).sum())
    record(
        name,
        int(apart.max()) <= ulps and scale_ok,
        f"{differ} of {apart.numel()} codes differ, max {int(apart.max())}; scales {'equal' if scale_ok else 'DIFFER'}",
    )


def correctness() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    x = randn(1000, 4096, scale=2.0, seed=1)
    x[7] = 0
    check_codes("quantize_fp8 per token, bf16 [1000, 4096]", *quantize_fp8(x), quantize_activation_ref(x))
    check_codes("quantize_fp8 per 128-group", *quantize_fp8(x, 128), quantize_activation_ref(x, 128))
    r = randn(1000, 4096, scale=4.0, seed=2)
    w = (1 + 0.2 * randn(4096, seed=3, dtype=torch.float32)).to(BF16)
    check_codes(
        "rms_norm_fp8 = quantize(rms_norm kernel)",
        *rms_norm_fp8(x, w, EPS),
        quantize_activation_ref(rms_norm(x, w, EPS)),
    )
    check_codes(
        "rms_norm_fp8 vs the PyTorch chain (<= 1 code)",
        *rms_norm_fp8(x, w, EPS),
        quantize_activation_ref(rms_norm_ref(x, w, EPS)),
        ulps=1,
    )
    data, scale, res = add_rms_norm_fp8(x, r, w, EPS)
    normed, ref_res = add_rms_norm(x, r, w, EPS)
    check_codes(
        "add_rms_norm_fp8 = quantize(add_rms_norm kernel)", data, scale, quantize_activation_ref(normed)
    )
    record(
        "add_rms_norm_fp8 residual = reference",
        torch.equal(res, add_rms_norm_ref(x, r, w, EPS)[1]) and torch.equal(res, ref_res),
    )
    gu = randn(1000, 2 * 12288, scale=3.0, seed=4)
    check_codes(
        "silu_and_mul_fp8 = quantize(silu_and_mul kernel)",
        *silu_and_mul_fp8(gu),
        quantize_activation_ref(silu_and_mul(gu)),
    )
    check_codes(
        "silu_and_mul_fp8 vs the PyTorch chain (<= 1 code)",
        *silu_and_mul_fp8(gu),
        quantize_activation_ref(silu_and_mul_ref(gu)),
        ulps=1,
    )

    a, wt = randn(300, 4096, seed=5), randn(6144, 4096, seed=6, scale=4096**-0.5)
    qa = QuantizedActivation(*quantize_fp8(a))
    w8, s8 = quantize_weight_per_channel(wt)
    ref = scaled_matmul_ref(qa, w8, s8, None, torch.float32)
    err = rel_err(fp8_gemm(qa.data, qa.scale, w8, s8, BF16), ref)
    record(
        "Triton FP8 GEMM per channel vs reference",
        err < 5e-3,
        f"rel err {err:.2e} (bf16 output rounding ~2e-3)",
    )
    err = rel_err(scaled_mm_rowwise(qa, w8, s8), ref)
    record("torch._scaled_mm row-wise vs reference", err < 5e-3, f"rel err {err:.2e}")
    wb, grid = quantize_weight_blocks(wt, (128, 128))
    rows = expand_block_scales(grid, 128, wt.shape[0])
    for label, act in (("per-token", qa), ("per-128-group", QuantizedActivation(*quantize_fp8(a, 128)))):
        ref = scaled_matmul_ref(act, wb, rows, None, torch.float32)
        err = rel_err(fp8_gemm(act.data, act.scale, wb, rows, BF16, group_k=128), ref)
        record(f"Triton block-scaled GEMM, {label} act. vs reference", err < 5e-3, f"rel err {err:.2e}")

    for block_k in (None, 128):
        dense = torch.nn.Linear(a.shape[1], 2048, bias=True, device=DEV, dtype=BF16)
        layer = Fp8Linear.replacing(dense, block_k)
        dispatch.FORCE_KERNELS = False
        ref = layer(a)
        dispatch.FORCE_KERNELS = None
        out, given = layer(a), layer(qa)
        err = rel_err(out, ref)
        record(
            f"Fp8Linear ({'per channel' if block_k is None else 'blocks'}) kernels vs reference path",
            err < 5e-3 and torch.equal(out, given),
            f"rel err {err:.2e}",
        )
    check_graph()


def check_graph() -> None:
    """norm (fp8 out) -> Fp8Linear -> SiLU-and-mul (fp8 out) -> Fp8Linear, captured, replayed on new input."""
    norm = RMSNorm(4096).to(DEV, BF16)
    norm.fp8_output = True
    up = Fp8Linear.replacing(torch.nn.Linear(4096, 2 * 3072, bias=False, device=DEV, dtype=BF16), None)
    act = SiluAndMul()
    act.fp8_output = True
    down = Fp8Linear.replacing(torch.nn.Linear(3072, 4096, bias=False, device=DEV, dtype=BF16), None)
    x, r = randn(64, 4096, seed=7), randn(64, 4096, seed=8)

    def step() -> torch.Tensor:
        h, _ = norm(x, r)
        return down(act(up(h)))

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(randn(64, 4096, seed=9))
    graph.replay()
    torch.cuda.synchronize()
    record("CUDA graph replay of the FP8 MLP on new input (bitwise)", torch.equal(out, step()))


# -- 2. GEMMs -------------------------------------------------------------------------------------------


def time_gemms(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> dict[str, float | str]:
    """One shape at one M: bf16, _scaled_mm (alone; with x's quantization), Triton per channel and
    block-scaled (their default config, and the best of CONFIGS)."""
    wt, w8, s8 = weights["bf16"], weights["w8"], weights["s8"]
    qa = QuantizedActivation(*quantize_fp8(x))
    t: dict[str, float | str] = {"bf16": time_us(lambda: F.linear(x, wt))}
    t["scaled_mm"] = time_us(lambda: scaled_mm_rowwise(qa, w8, s8))
    t["scaled_mm+quant"] = time_us(lambda: scaled_mm_rowwise(QuantizedActivation(*quantize_fp8(x)), w8, s8))
    for label, wq, sq, gk in (
        ("triton_pc", w8, s8, 0),
        ("triton_block", weights["wb"], weights["brows"], 128),
    ):

        def run(config: GemmConfig | None, wq=wq, sq=sq, gk=gk) -> torch.Tensor:
            return fp8_gemm(qa.data, qa.scale, wq, sq, BF16, group_k=gk, config=config)

        t[f"{label}_default"] = time_us(lambda run=run: run(None))
        best = min(((time_us(lambda c=c, run=run: run(c)), c) for c in CONFIGS), key=lambda pair: pair[0])
        t[label] = best[0]
        t[f"{label}_cfg"] = f"{best[1].block_m}x{best[1].block_n}w{best[1].num_warps}s{best[1].num_stages}"
    return t


def gemms() -> None:
    rows, errors = [], []
    for name, k, n in SHAPES:
        wt = randn(n, k, seed=10, scale=k**-0.5)
        w8, s8 = quantize_weight_per_channel(wt)
        wb, grid = quantize_weight_blocks(wt, (128, 128))
        brows = expand_block_scales(grid, 128, n)
        wr, sr = requantize_per_channel(wb, brows)
        weights = {"bf16": wt, "w8": w8, "s8": s8, "wb": wb, "brows": brows}
        for m in MS:
            t = time_gemms(randn(m, k, seed=11), weights)
            flops = 2 * m * n * k
            rows.append(
                {
                    "shape": name,
                    "m": m,
                    **{key: (round(v, 1) if isinstance(v, float) else v) for key, v in t.items()},
                    "bf16_tflops": round(flops / t["bf16"] / 1e6),
                    "fp8_tflops": round(flops / t["scaled_mm"] / 1e6),
                }
            )
            print(
                f"  {name:<8} M={m:<6} bf16 {t['bf16']:8.1f} us | scaled_mm {t['scaled_mm']:8.1f} "
                f"(+quant {t['scaled_mm+quant']:8.1f}) | triton pc {t['triton_pc']:8.1f} [{t['triton_pc_cfg']}; "
                f"default {t['triton_pc_default']:.1f}] | triton block {t['triton_block']:8.1f} "
                f"[{t['triton_block_cfg']}; default {t['triton_block_default']:.1f}]",
                flush=True,
            )
        # block checkpoint: kept as blocks vs requantized per channel, against its own dequantized weights
        x = randn(1024, k, seed=12)
        ref = x.float() @ dequantize_weight(wb, brows).T
        qa, qg = QuantizedActivation(*quantize_fp8(x)), QuantizedActivation(*quantize_fp8(x, 128))
        errors.append(
            {
                "shape": name,
                "bf16_dequantized_weights": rel_err(F.linear(x, dequantize_weight(wb, brows).to(BF16)), ref),
                "blocks_per_token_act": rel_err(
                    fp8_gemm(qa.data, qa.scale, wb, brows, BF16, group_k=128), ref
                ),
                "blocks_per_group_act": rel_err(
                    fp8_gemm(qg.data, qg.scale, wb, brows, BF16, group_k=128), ref
                ),
                "requantized_per_channel": rel_err(scaled_mm_rowwise(qa, wr, sr), ref),
                "online_per_channel_vs_bf16": rel_err(
                    scaled_mm_rowwise(qa, w8, s8), x.float() @ wt.float().T
                ),
            }
        )
    print(
        "\n  block checkpoint error (relative Frobenius, M=1024, vs x @ dequantized checkpoint weights^T in fp32):"
    )
    for e in errors:
        print("   ", "  ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{v:<8}" for k, v in e.items()))
    summary["gemm"] = rows
    summary["block_errors"] = errors
    print(f"  default_config picks: {[(m, default_config(m, 4096, 4096, 0)) for m in (128, 1024)]}")


# -- 3. fused activation quantization ---------------------------------------------------------------------


def time_fused(m: int, w: torch.Tensor) -> dict[str, float]:
    x, r, gu = randn(m, 4096, seed=13), randn(m, 4096, seed=14), randn(m, 2 * 12288, seed=15)
    return {
        "add_norm_fp8_fused": time_us(lambda: add_rms_norm_fp8(x, r, w, EPS)),
        "add_norm_then_quant": time_us(lambda: quantize_fp8(add_rms_norm(x, r, w, EPS)[0])),
        "norm_fp8_fused": time_us(lambda: rms_norm_fp8(x, w, EPS)),
        "norm_then_quant": time_us(lambda: quantize_fp8(rms_norm(x, w, EPS))),
        "silu_fp8_fused": time_us(lambda: silu_and_mul_fp8(gu)),
        "silu_then_quant": time_us(lambda: quantize_fp8(silu_and_mul(gu))),
        "quant_only_4096": time_us(lambda: quantize_fp8(x)),
    }


def fused_ops() -> None:
    out = []
    w = torch.ones(4096, device=DEV, dtype=BF16)
    for m in (128, 1024, 16384):
        t = time_fused(m, w)
        print(f"  M={m:<6} " + "  ".join(f"{k} {v:.1f}" for k, v in t.items()) + " us", flush=True)
        out.append({"m": m, **{k: round(v, 1) for k, v in t.items()}})
    summary["fused"] = out


# -- 4. accuracy on a random Qwen3-0.6B --------------------------------------------------------------------


def unit_gain_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> bf16 tensor, drawn per name (order-independent): norms 1, embeddings (tied to the LM
    head) N(0, 1), projections N(0, 1 / fan_in) so each layer keeps its input's size."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("weight_scale"):
            continue
        gen = torch.Generator(device=DEV).manual_seed(zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):
            out[name] = torch.ones(p.shape, device=DEV, dtype=BF16)
        elif "embed_tokens" in name or "lm_head" in name:
            out[name] = torch.randn(p.shape, generator=gen, device=DEV).to(BF16)
        else:
            out[name] = (torch.randn(p.shape, generator=gen, device=DEV) / p.shape[-1] ** 0.5).to(BF16)
    return out


@torch.no_grad()
def load_weights_(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """In place (the captured CUDA graphs read these tensors); FP8 layers quantize theirs."""
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        if name.endswith("weight_scale"):
            continue
        owner = modules[name.rpartition(".")[0]]
        if isinstance(owner, Fp8Linear) and name.endswith(".weight"):
            owner.load_dense_(weights[name])
        else:
            p.copy_(weights[name])


@torch.inference_mode()
def teacher_forced(
    model: torch.nn.Module, seqs: list[list[int]], starts: list[int]
) -> dict[str, torch.Tensor]:
    """At each generated position: argmax, logprob of the given token, top-2 margin, top-1 prob."""
    from overnight.attention.metadata import AttentionBatch
    from overnight.attention.torch_backend import TorchAttentionBackend, build_metadata

    arch, dtype = model.arch, next(model.parameters()).dtype
    dtype = dtype if dtype in (torch.float32, BF16) else BF16
    got: dict[str, list[torch.Tensor]] = {"argmax": [], "logprob": [], "margin": [], "top1_prob": []}
    for i in range(0, len(seqs), 8):
        chunk, first = seqs[i : i + 8], starts[i : i + 8]
        lens = [len(s) for s in chunk]
        tables, used = [], 0
        for n in lens:
            tables.append(list(range(used, used + -(-n // 16))))
            used += -(-n // 16)
        caches = [
            torch.zeros(2, used, 16, arch.num_key_value_heads, arch.head_dim, device=DEV, dtype=dtype)
            for _ in range(arch.num_hidden_layers)
        ]
        meta = build_metadata(lens, lens, tables, 16, device=DEV)
        ids = torch.tensor([t for s in chunk for t in s], device=DEV)
        pos = torch.cat([torch.arange(n, device=DEV) for n in lens])
        hidden = model(ids, pos, AttentionBatch(meta, caches, TorchAttentionBackend()))
        offset, rows, targets = 0, [], []
        for s, st in zip(chunk, first):
            rows += range(offset + st - 1, offset + len(s) - 1)
            targets += s[st:]
            offset += len(s)
        lp = model.compute_logits(hidden[torch.tensor(rows, device=DEV)]).float().log_softmax(-1)
        top2 = lp.topk(2, dim=-1).values
        got["argmax"].append(lp.argmax(-1))
        got["logprob"].append(lp.gather(1, torch.tensor(targets, device=DEV)[:, None])[:, 0])
        got["margin"].append(top2[:, 0] - top2[:, 1])
        got["top1_prob"].append(top2[:, 0].exp())
        del lp, hidden, caches
    return {k: torch.cat(v) for k, v in got.items()}


def accuracy() -> None:
    from overnight import LLM, SamplingParams
    from overnight.loader.resolve import resolve_source

    opts = dict(
        model=ACCURACY_MODEL,
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_num_seqs=64,
        max_model_len=512,
        kv_cache_memory_bytes=8 << 30,
    )
    rng = random.Random(0)
    vocab = resolve_source(ACCURACY_MODEL, "dummy").arch.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 256))] for _ in range(NUM_PROMPTS)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]

    llm = LLM(**opts)
    model = llm.engine.runner.model
    weights = unit_gain_weights(model)
    load_weights_(model, weights)
    bf16_tokens = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    seqs = [p + t for p, t in zip(prompts, bf16_tokens)]
    starts = [len(p) for p in prompts]
    target = torch.tensor([t for ts in bf16_tokens for t in ts], device=DEV)
    ref = teacher_forced(model, seqs, starts)
    fp32 = teacher_forced(copy.deepcopy(model).float(), seqs, starts)
    del llm, model
    gc.collect()
    torch.cuda.empty_cache()

    llm8 = LLM(**opts, quantization="fp8")
    model8 = llm8.engine.runner.model
    layers = model8.arch.num_hidden_layers
    record(
        "FP8 engine: every projection is an Fp8Linear",
        sum(isinstance(m, Fp8Linear) for m in model8.modules()) == 4 * layers,
    )
    load_weights_(model8, weights)
    fp8_tokens = [o.outputs[0].token_ids for o in llm8.generate(requests, params, use_tqdm=False)]
    got = teacher_forced(model8, seqs, starts)

    decided = ref["margin"] >= 1.0
    same = sum(a == b for a, b in zip(fp8_tokens, bf16_tokens))
    before = sum(
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for a, b in zip(fp8_tokens, bf16_tokens)
    )
    acc = {
        "bf16_self_top1": (ref["argmax"] == target)
        .float()
        .mean()
        .item(),  # teacher-forced vs the engine's own greedy
        "bf16_mean_top1_prob": ref["top1_prob"].mean().item(),
        "decided_share": decided.float().mean().item(),
        "fp8_top1": (got["argmax"] == target).float().mean().item(),
        "fp8_mean_abs_dlogprob": (got["logprob"] - ref["logprob"]).abs().mean().item(),
        "fp8_top1_decided": (got["argmax"] == target)[decided].float().mean().item(),
        "fp32_top1": (fp32["argmax"] == target).float().mean().item(),
        "fp32_mean_abs_dlogprob": (fp32["logprob"] - ref["logprob"]).abs().mean().item(),
        "fp32_top1_decided": (fp32["argmax"] == target)[decided].float().mean().item(),
        "engine_fp8_identical_sequences": same,
        "engine_fp8_share_before_divergence": before / (NUM_PROMPTS * NEW_TOKENS),
    }
    for k, v in acc.items():
        print(f"  {k:<36} {v:.4f}" if isinstance(v, float) else f"  {k:<36} {v}")
    record(
        "teacher-forced top-1 agreement FP8 vs bf16 >= 95%",
        acc["fp8_top1"] >= 0.95,
        f"{100 * acc['fp8_top1']:.2f}% (fp32 vs bf16: {100 * acc['fp32_top1']:.2f}%)",
    )
    summary["accuracy"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in acc.items()}


def main() -> int:
    name = torch.cuda.get_device_name()
    cap = torch.cuda.get_device_capability()
    print(
        f"{name}, sm_{cap[0]}{cap[1]}, torch {torch.__version__}, triton {triton.__version__}, SM clock {sm_clock_now()}"
    )
    if cap < (8, 9):
        print("FP8 tensor cores need sm_89+; nothing to measure")
        return 1
    t0 = time.time()
    section("1. correctness", correctness)
    section("2. GEMMs (us, median; Triton: best config [tile, warps, stages])", gemms)
    section("3. fused activation quantization (us)", fused_ops)
    section("4. accuracy, random Qwen3-0.6B, 64 prompts x 128 greedy tokens", accuracy)
    passed = sum(ok for _, ok, _ in checks)
    print(
        f"\n== summary: {passed}/{len(checks)} checks ok, {time.time() - t0:.0f} s, SM clock {sm_clock_now()}"
    )
    for label, ok, detail in checks:
        if not ok:
            print(f"  FAIL {label}: {detail}")
    if "gemm" in summary:
        print(
            f"  {'shape':<8} {'M':>6} {'bf16':>8} {'scaled_mm':>10} {'+quant':>8} {'triton pc':>10} {'triton blk':>10}  best FP8 vs bf16"
        )
        for r in summary["gemm"]:
            best = min(r["scaled_mm+quant"], r["triton_pc"], r["triton_block"])
            print(
                f"  {r['shape']:<8} {r['m']:>6} {r['bf16']:>8} {r['scaled_mm']:>10} {r['scaled_mm+quant']:>8} {r['triton_pc']:>10} {r['triton_block']:>10}  {r['bf16'] / best:.2f}x"
            )
    print(json.dumps({"checks_ok": passed, "checks": len(checks), "sm_clock": sm_clock_now(), **summary}))
    return 0 if passed == len(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
