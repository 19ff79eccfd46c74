"""Tier (c): Gemma 4's windowed layers give their blocks back (engine/kv_groups.py), against HF
transformers, fp32 greedy.

A tiny Gemma4ForCausalLM with Gemma-4-31B's proportions: windowed layers with 2 KV heads x 16, full
layers with 1 KV head x 16 (K = V), five windowed to one full, and two KV-shared last layers. Its cache
shapes differ: a full layer needs half a slot per token, so the full-attention group's blocks hold
twice the tokens (block scale 2, pages of 8 tokens beside the windowed layers' 4), and the windows give
back five of six layers' blocks. The same pool bytes are run with that layout, with the same groups at
one block size (the full blocks half padding) and with one tensor per layer of its own shape (one
group: nothing given back), counting the sequences long at once, and the tokens are checked against
transformers."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.engine.kv_groups import KVCacheLayout
from overnight.loader.resolve import resolve_source
from tests.engine_helpers import peak_long_running
from tests.parity_helpers import hf_greedy
from tests.test_gemma import _spread_weights, agrees

pytestmark = pytest.mark.slow  # real models beside transformers

W = 12
VOCAB = 331
LAYERS = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention", "full_attention"]
CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=16,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=VOCAB,
    max_position_embeddings=256,
    layer_types=LAYERS,
    final_logit_softcapping=8.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 10000.0},
    },
)
# The MoE variant (Gemma-4-26B-A4B's shape): experts beside the MLP, no KV-shared layers, no per-layer inputs.
MOE: dict[str, Any] = dict(
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    enable_moe_block=True,
    num_experts=5,
    top_k_experts=2,
    moe_intermediate_size=20,
)
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4)


def tiny_gemma4(window: int, moe: bool = False) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Gemma4TextConfig(**{**CONFIG, **(MOE if moe else {})}, sliding_window=window)
    model = tf.Gemma4ForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    _spread_weights(model, one_centred_norms=False)
    return model


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    model = tiny_gemma4(W)
    folder = tmp_path_factory.mktemp("gemma4") / "model"
    model.save_pretrained(folder)
    return str(folder), model


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory):
    model = tiny_gemma4(W, moe=True)
    folder = tmp_path_factory.mktemp("gemma4-moe") / "model"
    model.save_pretrained(folder)
    return str(folder), model


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_layout_and_transformers_applies_the_window(gemma4):
    folder, ref = gemma4
    layout = KVCacheLayout.from_arch(resolve_source(folder).arch, 160)
    assert layout.windows == (None,) + (W,) * 5 and layout.tensor_elems == (32,)
    # The full layers' 1 x 16 in slots of 2 x 16: blocks of twice the tokens, none of it padding.
    assert layout.block_scales == (2,) + (1,) * 5 and layout.unused_share(0) == 0.0
    assert layout.layer_source[6:] == (4, 5)
    prompt = [random.Random(0).randrange(3, 320) for _ in range(40)]
    wide = tiny_gemma4(4096)  # the same weights, a window longer than any prompt
    assert hf_greedy(ref, prompt, 8)[0] != hf_greedy(wide, prompt, 8)[0]


def test_windows_and_block_scales_hold_more_sequences_and_the_same_tokens(gemma4, monkeypatch):
    """The same pool bytes, at a context of 20 + 124 tokens: count the sequences long at once. A
    sequence holds 18 full blocks + 5 x 4 windowed with the full blocks of 8 tokens, 36 + 5 x 4 with
    them half padding (1.47x), every layer's 144 tokens with one tensor per layer. Measured: 13, 9 and
    2 sequences at once."""
    folder, ref = gemma4
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 320) for _ in range(20)] for _ in range(20)]
    grouped = KVCacheLayout.from_arch(resolve_source(folder).arch, 160)
    padded = replace(grouped, block_scales=(1,) * grouped.num_groups)
    per_layer = KVCacheLayout.uniform(resolve_source(folder).arch)
    long_at_once, outputs = {}, {}
    for name, layout in (("per layer", per_layer), ("padded", padded), ("grouped", grouped)):
        monkeypatch.setattr(KVCacheLayout, "from_arch", classmethod(lambda cls, a, m=None, lay=layout: lay))
        llm = LLM(
            folder,
            kv_cache_memory_bytes=1 << 19,
            max_model_len=160,
            max_num_seqs=32,
            enable_prefix_caching=False,
            **ENGINE,
        )
        engine = llm.engine
        assert engine.runner.kv_layout is layout  # type: ignore[attr-defined]
        peak, done = peak_long_running(engine, prompts, greedy(124), 128)
        assert engine.kv.pool.num_free == engine.kv.pool.num_blocks  # type: ignore[attr-defined]
        long_at_once[name], outputs[name] = peak, done
    assert long_at_once["per layer"] >= 1
    assert long_at_once["padded"] >= 3 * long_at_once["per layer"], long_at_once
    assert long_at_once["grouped"] >= 1.3 * long_at_once["padded"], long_at_once
    assert outputs["grouped"] == outputs["per layer"] == outputs["padded"]
    for i in range(0, 20, 7):  # transformers is slow at this length: three of them
        ours, (theirs, scores) = outputs["grouped"][str(i)], hf_greedy(ref, prompts[i], 124)
        assert agrees(ours, theirs, scores), i


@pytest.mark.parametrize("variant", ["gemma4", "gemma4_moe"])
def test_prefix_hits_and_preemption_on_a_small_pool_match_transformers(variant, request):
    """Shared prefixes longer than the window (a hit needs the window's blocks in every windowed
    group, and whole blocks of 8 tokens of the full group), chunks crossing it, and a pool too small
    for all at once."""
    folder, ref = request.getfixturevalue(variant)
    layout = KVCacheLayout.from_arch(resolve_source(folder).arch, 128)
    assert layout.block_scales[0] == 2 and set(layout.block_scales[1:]) == {1}
    rng = random.Random(1)
    prefix = [rng.randrange(3, 320) for _ in range(30)]
    prompts = [prefix + [rng.randrange(3, 320) for _ in range(k)] for k in (3, 7, 11)]
    prompts += [[rng.randrange(3, 320) for _ in range(k)] for k in (5, 13, 40, 57)]
    block = 4 * 2 * sum(layout.tensor_elems) * 4  # 4 tokens x K/V x the slots (32 elements each) x fp32
    llm = LLM(
        folder,
        kv_cache_memory_bytes=100 * block,
        max_num_batched_tokens=16,
        max_model_len=128,
        schedule="fifo",  # input order: the hits that survive the preemptions do not depend on timing
        admission="greedy",  # start whatever fits now, so that running requests outgrow the pool
        **ENGINE,
    )
    assert llm.engine.pool_plan.num_blocks == 100
    llm.generate([{"prompt_token_ids": prompts[0]}], greedy(2), use_tqdm=False)  # caches the prefix
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(24), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        theirs, scores = hf_greedy(ref, prompt, 24)
        assert agrees(out.outputs[0].token_ids, theirs, scores), f"prompt of {len(prompt)} tokens"
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0
    # The first prompt again starts past 32 tokens, the other sharers past 24 (28 shared, cut to whole
    # blocks of 8 of the full group), unless the small pool evicted the prefix meanwhile.
    assert stats.prefix_cache_hits >= 2 * 24
    assert llm.engine.kv.pool.num_free == 100  # type: ignore[attr-defined]


def test_fp8_cache_gives_the_same_tokens_in_either_layout(gemma4, monkeypatch):
    """An FP8 cache (head-major K, token-major V inside each block, kernels/kv_layout.py) read through
    views of their group's page (8 tokens for the full layers, 4 for the windowed ones) holds the very
    values one tensor per layer holds: the tokens are identical."""
    folder, _ = gemma4
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 320) for _ in range(k)] for k in (9, 30, 41)]
    arch = resolve_source(folder).arch
    outs = {}
    for name, layout in (
        ("grouped", KVCacheLayout.from_arch(arch, 96)),
        ("per layer", KVCacheLayout.uniform(arch)),
    ):
        monkeypatch.setattr(KVCacheLayout, "from_arch", classmethod(lambda cls, a, m=None, lay=layout: lay))
        llm = LLM(folder, kv_cache_dtype="fp8", max_num_batched_tokens=16, max_model_len=96, **ENGINE)
        assert llm.engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn  # type: ignore[attr-defined]
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(16), use_tqdm=False)
        outs[name] = [o.outputs[0].token_ids for o in got]
    assert outs["grouped"] == outs["per layer"]


def test_tensor_parallel_ranks_block_scales_rule_the_tables(gemma4):
    """On 2 ranks each holds 1 of the windowed layers' 2 KV heads and the full layers' one head whole:
    both fill a rank's slot, so the ranks' pages are of one size (block scales 1) where one device's
    full group has blocks of 2 x 4 tokens. The engine's tables follow the ranks' layout (PoolPlan), and
    the tokens equal one device's and transformers'."""
    folder, ref = gemma4
    rng = random.Random(7)
    prefix = [rng.randrange(3, 320) for _ in range(30)]
    prompts = [prefix + [rng.randrange(3, 320) for _ in range(k)] for k in (2, 9)]
    prompts.append([rng.randrange(3, 320) for _ in range(41)])
    options = dict(max_num_batched_tokens=16, max_model_len=96, **ENGINE)
    one = LLM(folder, **options)
    assert one.engine.kv.scales == (2,) + (1,) * 5  # type: ignore[attr-defined]
    want = [o.outputs[0].token_ids for o in one.generate(_inputs(prompts), greedy(12), use_tqdm=False)]
    llm = LLM(folder, tensor_parallel_size=2, **options)
    try:
        assert llm.engine.kv.scales == (1,) * 6  # type: ignore[attr-defined]
        got = [o.outputs[0].token_ids for o in llm.generate(_inputs(prompts), greedy(12), use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert got == want
    for prompt, ours in zip(prompts, got):
        theirs, scores = hf_greedy(ref, prompt, 12)
        assert agrees(ours, theirs, scores), len(prompt)


def _inputs(prompts: list[list[int]]) -> list[Any]:
    return [{"prompt_token_ids": p} for p in prompts]


def test_triton_kernels_read_each_layers_page(gemma4):
    """The Triton attention path (the interpreter on the CPU) on the block-scale layout: the full
    layers' kernels read pages of 8 tokens, the windowed layers' of 4, over the same tensors; the
    tokens equal the torch reference path's."""
    folder, _ = gemma4
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 320) for _ in range(k)] for k in (9, 30)]
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(folder, attention_backend=backend, max_num_batched_tokens=16, max_model_len=64, **ENGINE)
        caches = llm.engine.runner.kv_caches  # type: ignore[attr-defined]
        assert (caches[5].shape[2], caches[0].shape[2]) == (8, 4)
        got = llm.generate(_inputs(prompts), greedy(6), use_tqdm=False)
        outs[backend] = [o.outputs[0].token_ids for o in got]
    assert outs["triton"] == outs["torch"]
