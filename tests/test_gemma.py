"""Gemma 2/3/4 end to end on the CPU: the engine against transformers, greedy in fp32, on tiny random
checkpoints saved with save_pretrained: Gemma2ForCausalLM (both softcaps), Gemma3ForCausalLM (local vs
linear-scaled global RoPE, q/k norms), Gemma3ForConditionalGeneration (text prompts; its
vision tower loads too: tests/test_gemma_vision.py runs images), Gemma4ForCausalLM (KV-shared layers, attention_k_eq_v, per-layer inputs, 16-wide sliding and
24-wide full heads, proportional RoPE), Gemma4ForConditionalGeneration (text) and the Gemma 4 MoE.

Each has 4 layers of both kinds with a window of 7 tokens and blocks of 4, and is run twice:
- with prefix caching and max_num_batched_tokens=8 on prompts up to 45 tokens, three of which share a
  29-token prefix: windows cross block edges, chunk edges and cached-prefix edges;
- on a KV pool of 80 tokens, so the scheduler preempts and recomputes.
Tokens must equal transformers' greedy tokens. A first divergence where the reference's top two logits
are within 1e-4 counts as agreement (a near-tie, where fp32 rounding decides); from there on the two
continue from different tokens and are not compared. With these seeds none occurs.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.engine.kv_groups import KVCacheLayout
from overnight.loader.resolve import resolve_source
from tests.test_engine_parity import hf_greedy

pytestmark = pytest.mark.slow  # real engines beside transformers

WINDOW = 7
BLOCK = 4
NEW_TOKENS = 10
VOCAB = 331
PROMPT_VOCAB = 320  # ids 320.. are the multimodal configs' special tokens
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    sliding_window=WINDOW,
    layer_types=LAYER_TYPES,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,  # random tied tables make a tiny model repeat its last token
)
_GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
}
_GEMMA4: dict[str, Any] = dict(
    global_head_dim=24,
    final_logit_softcapping=8.0,
    attention_k_eq_v=True,
    num_global_key_value_heads=1,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 10000.0},
    },
)
_GEMMA4_DENSE: dict[str, Any] = dict(
    _GEMMA4,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,  # the KV-shared layers' MLPs are twice as wide
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=VOCAB,
)
_GEMMA4_MOE: dict[str, Any] = dict(
    _GEMMA4,
    hidden_size_per_layer_input=0,
    enable_moe_block=True,
    num_experts=5,
    top_k_experts=2,
    moe_intermediate_size=20,
)
VARIANTS = (
    "gemma2",
    "gemma3",
    "gemma3-multimodal",
    "gemma4",
    "gemma4-multimodal",
    "gemma4-moe",
)


def tiny_gemma(variant: str) -> torch.nn.Module:
    """The transformers model of `variant` (fp32, eval), with spread random weights."""
    import transformers as tf

    if variant == "gemma2":
        config: Any = tf.Gemma2Config(
            **_COMMON, query_pre_attn_scalar=20, attn_logit_softcapping=5.0, final_logit_softcapping=8.0
        )
        cls: Any = tf.Gemma2ForCausalLM
    elif variant.startswith("gemma3"):
        config = tf.Gemma3TextConfig(
            **_COMMON, query_pre_attn_scalar=20, final_logit_softcapping=8.0, rope_parameters=_GEMMA3_ROPE
        )
        cls = tf.Gemma3ForCausalLM
        if variant == "gemma3-multimodal":
            vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
            config = tf.Gemma3Config(
                text_config=config.to_dict(),
                vision_config=dict(vision, image_size=28, patch_size=14),
                mm_tokens_per_image=4,
                boi_token_index=328,
                eoi_token_index=329,
                image_token_index=330,
                tie_word_embeddings=False,
            )
            cls = tf.Gemma3ForConditionalGeneration
    else:
        config = tf.Gemma4TextConfig(**_COMMON, **(_GEMMA4_MOE if variant == "gemma4-moe" else _GEMMA4_DENSE))
        cls = tf.Gemma4ForCausalLM
        if variant == "gemma4-multimodal":
            vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
            # Out of the vocabulary: transformers embeds any placeholder id as padding, a generated one too.
            ids = dict(boi_token_id=1001, eoi_token_id=1002, image_token_id=1003, video_token_id=1004)
            ids |= dict(boa_token_id=1005, eoa_token_index=1006, audio_token_id=1007)
            config = tf.Gemma4Config(
                text_config=config.to_dict(),
                vision_config=dict(vision, num_key_value_heads=2, head_dim=8, position_embedding_size=64),
                tie_word_embeddings=False,
                **ids,
            )
            cls = tf.Gemma4ForConditionalGeneration
    torch.manual_seed(0)
    model = cls(config).eval()
    model.set_attn_implementation("eager")  # transformers' SDPA path leaves out Gemma 2's softcap
    _spread_weights(model, one_centred_norms=not variant.startswith("gemma4"))
    return model


@torch.no_grad()
def _spread_weights(model: torch.nn.Module, one_centred_norms: bool) -> None:
    """Unit-variance projections and N(0, 1) embeddings (well separated logits, so greedy has no
    near-ties); norms and Gemma 4's scalars near 1 (Gemma 2/3 store norms as w of 1 + w: near 0)."""
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")):
            p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
            if one_centred_norms and name.endswith("norm.weight"):
                p.sub_(1.0)
        elif "embed_tokens" in name or "lm_head" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    varied = [[rng.randrange(3, PROMPT_VOCAB) for _ in range(n)] for n in (2, 9, 16, 23, 45)]
    prefix = [rng.randrange(3, PROMPT_VOCAB) for _ in range(29)]
    shared = [prefix + [rng.randrange(3, PROMPT_VOCAB) for _ in range(n)] for n in (1, 4, 6)]
    return shared + varied


def agrees(ours: list[int], ref: list[int], scores: list[torch.Tensor]) -> bool:
    """Token-exact, or exact up to a first divergence at a near-tie of the reference (module docstring)."""
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            top2 = scores[step].topk(2).values
            return bool(top2[0] - top2[1] < 1e-4)
    return True


def greedy(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=VARIANTS)
def checkpoint(request, tmp_path_factory):
    model = tiny_gemma(request.param)
    folder = tmp_path_factory.mktemp(request.param) / "model"
    model.save_pretrained(folder)
    batch = prompts()
    reference = [hf_greedy(model, p, NEW_TOKENS) for p in batch]
    return request.param, str(folder), batch, reference


def test_architecture_is_read_as_configured(checkpoint):
    variant, folder, _, _ = checkpoint
    arch = resolve_source(folder).arch
    assert arch.architecture == variant.split("-")[0]
    assert [arch.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    if variant.startswith("gemma4"):
        assert (arch.layer_head_dim(0), arch.layer_head_dim(1)) == (16, 24)
        assert (arch.layer_num_kv_heads(0), arch.layer_num_kv_heads(1)) == (2, 1)
        assert arch.num_kv_shared_layers == (0 if variant == "gemma4-moe" else 2)
    # Windowed and full layers in groups of their own (Gemma 4's despite their different cache shapes).
    assert KVCacheLayout.from_arch(arch, 64).windows == (None, WINDOW)


def test_prefix_cache_and_chunks_across_the_window_match_transformers(checkpoint):
    _, folder, batch, reference = checkpoint
    engine = dict(skip_tokenizer_init=True, dtype="float32", block_size=BLOCK, max_model_len=64)
    llm = LLM(folder, **engine, max_num_batched_tokens=8, max_num_seqs=8, kv_cache_memory_bytes=8 << 20)
    greedy(llm, batch[:1])  # caches the shared prefix
    hits = llm.engine.kv.prefix_hits
    outs = greedy(llm, batch)
    assert llm.engine.kv.prefix_hits - hits >= 2 * 28  # the two other sharers found 7 blocks each
    for prompt, ours, (ref, scores) in zip(batch, outs, reference):
        assert agrees(ours, ref, scores), f"prompt of {len(prompt)} tokens: {ours} != {ref}"
    assert len({t for out in outs for t in out}) > 20  # varied outputs: a mixed-up batch would show


def test_preemption_on_a_tiny_pool_matches_transformers(checkpoint):
    _, folder, batch, reference = checkpoint
    arch = resolve_source(folder).arch
    # Two or three of these requests at once: the windowed layers give their blocks back as windows
    # pass (engine/kv_groups.py). Gemma 4's full-attention blocks are padded to the windowed layers'
    # larger shape, so its pool holds fewer tokens per byte: 80 tokens' worth of its real K/V bytes.
    pool = (80 if arch.global_head_dim else 64) * arch.kv_bytes_per_token(4)
    llm = LLM(
        folder,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=64,
        kv_cache_memory_bytes=pool,
        enable_prefix_caching=False,
        schedule="fifo",  # input order: the look-ahead order would group the sharers and may avoid preempting
        admission="greedy",  # start whatever fits now, so that running requests outgrow the pool
    )
    outs = greedy(llm, batch)
    assert llm.engine.scheduler.num_preemptions_total > 0
    for prompt, ours, (ref, scores) in zip(batch, outs, reference):
        assert agrees(ours, ref, scores), f"prompt of {len(prompt)} tokens: {ours} != {ref}"
