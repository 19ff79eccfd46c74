"""overnight/bench/roofline.py: the bound `overnight bench throughput` reports its fractions against.
The weights a step reads are the model's as loaded (FP8 halves them), and a KV pool smaller than the
batch's mean occupancy caps the requests that run at once (more steps, each reading the weights)."""

from __future__ import annotations

import pytest

from overnight import LLM
from overnight.bench.roofline import WeightBytes, config_weight_bytes, estimate, loaded_weight_bytes
from overnight.loader.resolve import resolve_source
from tests.tiny_models import tiny_config


@pytest.fixture(scope="module")
def moe_arch():
    return resolve_source("qwen3-30b-a3b", "dummy").arch


def test_the_config_count_of_qwen3_30b_a3b(moe_arch):
    bf16 = config_weight_bytes(moe_arch)
    # 48 layers x 128 experts x 3 x 2048 x 768 parameters, 2 bytes each: 58 GB of experts
    assert bf16.experts == 48 * 128 * 3 * 2048 * 768 * 2
    # attention (q 4096, k/v 512 each, o: 18.9M a layer), routers (128 x 2048 a layer), the LM head
    attention = 48 * (2048 * 4096 * 2 + 2048 * 512 * 2)
    assert bf16.dense == 2 * (attention + 48 * 128 * 2048 + 151936 * 2048)
    # 296 tokens of top-8 of 128 hit all but ~0.0002% of the experts; one token hits 8 of 128
    assert bf16.read_per_step(moe_arch, 296) == pytest.approx(bf16.dense + bf16.experts, rel=1e-4)
    assert bf16.read_per_step(moe_arch, 1) == pytest.approx(bf16.dense + bf16.experts * 8 / 128)


def test_fp8_weights_halve_the_memory_bound(moe_arch):
    reqs = [(1024, 1024)] * 512
    bf16 = estimate(moe_arch, reqs, 1024)
    half = config_weight_bytes(moe_arch)
    fp8 = estimate(moe_arch, reqs, 1024, weights=WeightBytes(half.dense / 2, half.experts / 2))
    kv = moe_arch.kv_bytes_per_token(2) * 512 * (1023 * 1024 + 1023 * 1024 / 2)
    weights_bf16 = bf16.bytes - kv
    assert fp8.bytes - kv == pytest.approx(weights_bf16 / 2)
    assert fp8.t_memory < bf16.t_memory


def test_a_small_pool_caps_the_requests_at_once(moe_arch):
    reqs = [(1024, 1024)] * 512
    unbounded = estimate(moe_arch, reqs, 1024)
    # a pool of 456,176 tokens at a mean occupancy of 1,536 tokens runs 296 requests at once
    pooled = estimate(moe_arch, reqs, 1024, pool_tokens=456_176)
    per_step = config_weight_bytes(moe_arch).read_per_step(moe_arch, 296)
    kv = moe_arch.kv_bytes_per_token(2) * 512 * (1023 * 1024 + 1023 * 1024 / 2)
    assert pooled.bytes == pytest.approx(kv + 512 * 1024 / 296 * per_step)
    assert pooled.bytes > unbounded.bytes
    assert pooled.flops == unbounded.flops  # the work is the same; only the weights are read more often


def test_loaded_bytes_follow_the_weights_as_held(tmp_path):
    """A tiny Qwen3-MoE loaded in bf16 and with FP8 weights: the experts' bytes halve (e4m3 plus a
    float32 scale a row), and the untied input embedding is not counted."""
    tiny_config("qwen3_moe", vocab_size=512, tie_word_embeddings=False).save_pretrained(tmp_path)
    arch = resolve_source(str(tmp_path), "dummy").arch
    held = {}
    for quant in (None, "fp8"):
        llm = LLM(
            str(tmp_path), load_format="dummy", dtype="bfloat16", quantization=quant, enforce_eager=True
        )
        held[quant] = loaded_weight_bytes(llm.engine.runner.model, arch)
    bf16, fp8 = held[None], held["fp8"]
    assert bf16.experts == config_weight_bytes(arch).experts
    rows = arch.num_hidden_layers * arch.num_experts * (2 * arch.moe_intermediate_size + arch.hidden_size)
    assert fp8.experts == bf16.experts / 2 + 4 * rows
    # bf16: the dense part is the config's (the LM head counted, the embedding table not), and norms
    norms = bf16.dense - config_weight_bytes(arch).dense
    assert 0 < norms < 2 * arch.hidden_size * (2 * arch.num_hidden_layers + 1) * 2 * 2
