"""The decode steps of the model families added without a GPU, checked on the CPU for what CUDA-graph
capture forbids (tests/sync_guard.py): every layer on its GPU path (FORCE_KERNELS, the Triton
interpreter), each decode-only forward of a short engine run under no_host_syncs. A host sync or a
data-dependent shape in a model, layer or kernel wrapper fails the test with its file and line. The
models run in float16, 16-bit activations as on the GPU (the interpreter has no bf16), so the kernel
wrappers also see the GPU's mix of dtypes (16-bit activations and norms, float32 routers, biases and
routing weights, e4m3 experts) rather than the CPU tests' all-float32.

Families: GLM-4.5 (grouped sigmoid router kernel, shared experts; float and online FP8 with e4m3
experts), Llama 4 (chunked attention, input-scaled experts), MiniMax-M2 (whole-vector q/k norms, partial RoPE), Mistral 3 and InternVL (dense and MoE)
decoding text after their towers, the Qwen3-Next hybrid under FP8 (the fused offset norms' dense and
quantized outputs), and a decoder sequence classifier's pooling run.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.kernels import dispatch
from tests.sync_guard import HostSync, no_host_syncs

ENGINE = dict(
    skip_tokenizer_init=True, dtype="float16", device="cpu", block_size=4, max_num_batched_tokens=32,
    max_num_seqs=4, kv_cache_memory_bytes=1 << 20,
)  # fmt: skip
PROMPTS = [[5, 9, 13, 17, 21, 25, 29], [6, 10, 14, 18, 22]]


def guard_decode_steps(model: torch.nn.Module) -> list[int]:
    """Run model's decode-only forwards under no_host_syncs from now on; the returned list counts them."""
    forward, seen = model.forward, []

    def guarded(input_ids, positions, attn, *args, **kwargs):
        if attn.meta.num_decodes == attn.meta.num_reqs:
            seen.append(1)
            with no_host_syncs():
                return forward(input_ids, positions, attn, *args, **kwargs)
        return forward(input_ids, positions, attn, *args, **kwargs)

    model.forward = guarded  # type: ignore[method-assign]
    return seen


def decode_guarded(folder: str, monkeypatch, **engine) -> None:
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    llm = LLM(model=str(folder), **{**ENGINE, **engine})
    seen = guard_decode_steps(llm.engine.runner.model)  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert seen, "no decode-only step ran"


def test_the_guard_catches_a_host_sync(monkeypatch):
    """The PyTorch path of the stacked experts loops over the experts hit (a sync per layer, the reason
    the GPU takes the fused kernel): the guard names it."""
    from overnight.layers.moe import Experts

    experts = Experts(4, 8, 16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    x, ids = torch.randn(3, 8), torch.tensor([[0, 1], [1, 2], [3, 0]], dtype=torch.int32)
    with no_host_syncs(), pytest.raises(HostSync, match=r"overnight/layers/moe\.py"):
        experts(x, torch.full((3, 2), 0.5), ids)
    experts(x, torch.full((3, 2), 0.5), ids)  # and is gone afterwards


@pytest.mark.slow  # the fused MoE kernels through the Triton interpreter
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_glm4_moe_decode(tmp_path, monkeypatch, quantization):
    from tests.test_glm4_moe import VARIANTS, make_glm_checkpoint

    folder = make_glm_checkpoint(tmp_path / "glm", **VARIANTS["qk-norm"])
    decode_guarded(folder, monkeypatch, quantization=quantization)


@pytest.mark.slow  # the fused MoE and chunked attention kernels through the Triton interpreter
def test_llama4_decode(tmp_path, monkeypatch):
    """Chunked layers (the decode kernel's CHUNK), the NoPE layers' position-scaled q, the weightless
    q/k norm, the input-scaled experts through the fused MoE with weight 1."""
    from tests.test_llama4 import make_llama4_checkpoint

    decode_guarded(make_llama4_checkpoint(tmp_path / "l4"), monkeypatch)


@pytest.mark.slow
def test_minimax_m2_decode(tmp_path, monkeypatch):
    from tests.test_minimax_m2 import make_minimax_checkpoint

    decode_guarded(make_minimax_checkpoint(tmp_path / "m2"), monkeypatch)


def test_mistral3_vl_decode(tmp_path, monkeypatch):
    from tests.tiny_mistral3_vl import make_mistral3_vl_checkpoint

    decode_guarded(make_mistral3_vl_checkpoint(tmp_path), monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True])
def test_internvl_decode(tmp_path, monkeypatch, moe):
    from tests.test_internvl_vision import VARIANTS
    from tests.tiny_internvl import make_internvl_checkpoint

    changes = VARIANTS["qwen3-moe"] if moe else {}
    decode_guarded(make_internvl_checkpoint(tmp_path, **changes), monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen3_next", "qwen3_5_moe"])
def test_hybrid_fp8_decode(tmp_path, monkeypatch, variant):
    """The offset norms hand over quantized and dense outputs (one kernel pass) to the FP8 projections
    and the bf16 b / a projections and router; the Gated DeltaNet's decode kernels take the states."""
    from tests.test_fp8_hybrid import make_float_checkpoint

    decode_guarded(make_float_checkpoint(tmp_path, variant), monkeypatch, quantization="fp8")


@pytest.mark.slow
def test_int4_moe_decode(tmp_path, monkeypatch):
    """Packed int4 experts (the w4a16 MoE kernel) and packed int4 projections."""
    from overnight.quant import apply
    from tests.int_checkpoints import make_int_checkpoint
    from tests.tiny_models import make_tiny_checkpoint

    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    src = make_tiny_checkpoint(tmp_path / "src", "qwen3_moe")
    quantized, _ = make_int_checkpoint(src, tmp_path / "awq", "awq-g32")
    decode_guarded(quantized, monkeypatch)
