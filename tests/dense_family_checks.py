"""What the tests of Seed-OSS, EXAONE 4, Apertus and Cohere / Cohere 2 share (tests/test_seed_oss.py,
test_exaone4.py, test_apertus.py, test_cohere.py): tiny random transformers checkpoints of each, and
three checks against transformers' model of the same checkpoint.

  - engine_matches_transformers: the LLM API (fp32, greedy, prefix caching, chunks of <= 11 tokens
    whose edges cross the 7-token window, a KV pool too small for a round, so requests are preempted
    and recomputed) token-exact against transformers' generate (tests/test_families.py's rounds);
  - parameter_count_matches: ModelArch.num_parameters against our meta model and transformers' model;
  - kernels_match_pytorch_path: the Triton path (norm / RoPE kernels and paged attention with windows)
    against the PyTorch path, through the interpreter on the CPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from overnight import LLM, SamplingParams
from overnight.loader.model_loader import build_model, load_model
from overnight.loader.resolve import resolve_source
from tests.test_families import _agree, _hf_greedy, _prompts
from tests.tiny_models import _spread_weights

WINDOW = 7
BLOCK = 4
NEW_TOKENS = 10
COMMON: dict[str, Any] = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

# name -> (transformers config class, model class, config overrides)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(attention_bias=True, attention_out_bias=True)),
    # The 32B's shape: sliding, full (no RoPE), sliding; llama3 RoPE on the sliding ones.
    "exaone4": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        dict(
            sliding_window=WINDOW,
            sliding_window_pattern=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),  # fmt: skip
    ),
    # The 1.2B's shape: no window, RoPE everywhere, tied embeddings.
    "exaone4-tied": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        dict(sliding_window=None, layer_types=["full_attention"] * 3, tie_word_embeddings=True),
    ),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(hidden_act="xielu")),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.25, tie_word_embeddings=True)),
    # Command R+: per-head q/k LayerNorms, a weight row per head.
    "cohere-plus": ("CohereConfig", "CohereForCausalLM", dict(use_qk_norm=True, tie_word_embeddings=True)),
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(logit_scale=0.5, sliding_window=WINDOW, sliding_window_pattern=2),
    ),
}


def make_model(variant: str, seed: int = 0, **changes: Any):
    """transformers' model of `variant` (fp32, eval mode, weights spread as tests/tiny_models.py does, so
    greedy decoding has few near-ties)."""
    import transformers

    config_cls, model_cls, overrides = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, **changes})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    _spread_weights(model, seed)
    return model


def make_checkpoint(tmp_path: str | os.PathLike, variant: str, seed: int = 0, **changes: Any) -> Path:
    folder = Path(tmp_path) / f"tiny-{variant}"
    make_model(variant, seed, **changes).save_pretrained(folder)
    return folder


def reference(folder: str | os.PathLike, variant: str):
    """The checkpoint loaded back with transformers (fp32, eval, eager attention)."""
    import transformers

    cls = getattr(transformers, VARIANTS[variant][1])
    return cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def engine_matches_transformers(folder: Path, variant: str) -> None:
    arch = resolve_source(str(folder)).arch
    ref = reference(folder, variant)
    first, second = _prompts(arch.vocab_size, seed=len(variant))
    llm = LLM(
        str(folder),
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=48,
        max_num_batched_tokens=11,  # chunks of <= 11 tokens: edges cross the 7-token window
        enable_prefix_caching=True,
        kv_cache_memory_bytes=12 * BLOCK * arch.kv_bytes_per_token(4),  # one request fits, not three
        admission="greedy",
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    ties = 0
    for prompts in (first, second):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            expected, scores = _hf_greedy(ref, prompt, stepwise=False)
            got = out.outputs[0].token_ids
            ok, tie = _agree(got, expected, scores)
            assert ok, f"{variant}: prompt of {len(prompt)} tokens: {got} != {expected}"
            ties += tie
            # The chosen tokens' logprobs (logit scales and norms show here, not in the argmax), up to
            # the first divergence.
            assert out.outputs[0].logprobs is not None
            for token, theirs, ours in zip(got, scores, out.outputs[0].logprobs):
                if token != int(theirs.argmax()):
                    break
                want = float(torch.log_softmax(theirs.float(), -1)[token])
                assert abs(ours[token].logprob - want) < 1e-3, (
                    f"{variant}: logprob {ours[token].logprob} != {want}"
                )
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert llm.engine.kv.prefix_hits > 0
    assert ties <= 1, f"{variant}: {ties} sequences ended at near-ties"


def bf16_close_to_transformers(folder: Path, variant: str, top_k: int = 5) -> None:
    """bf16 on both sides (the precision the published checkpoints run in). The house rule: greedy tokens
    equal up to the first divergence, and there each side's token among the other's top_k. Since that
    alone would pass a model that diverges at once, also: at least half of all steps come before their
    sequence's divergence, and there the chosen tokens' logprobs differ by 0.05 on average (correct
    code: 0.002-0.023 on these tiny models, whose large logits bf16 rounds by up to ~0.17)."""
    import transformers

    ref = (
        getattr(transformers, VARIANTS[variant][1])
        .from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="eager")
        .eval()
    )
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", device="cpu", block_size=BLOCK,
              max_model_len=64, max_num_batched_tokens=11)  # fmt: skip
    first, second = _prompts(211, seed=7)
    prompts = first + second
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=top_k)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    gaps: list[float] = []
    for prompt, out in zip(prompts, outs):
        theirs, scores = _hf_greedy(ref, prompt, stepwise=False)
        ours, our_logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
        assert our_logprobs is not None
        for a, b, score, lp in zip(ours, theirs, scores, our_logprobs):
            their_lp = torch.log_softmax(score.float(), -1)
            if a != b:
                assert b in lp and a in their_lp.topk(top_k).indices.tolist(), (
                    f"{variant}: {ours} vs {theirs}"
                )
                break
            gaps.append(abs(lp[a].logprob - float(their_lp[a])))
    assert len(gaps) >= len(prompts) * NEW_TOKENS / 2, f"{variant}: {len(gaps)} steps before divergences"
    assert sum(gaps) / len(gaps) < 0.05, f"{variant}: mean logprob gap {sum(gaps) / len(gaps):.3f}"


def parameter_count_matches(folder: Path, variant: str) -> None:
    arch = resolve_source(str(folder)).arch
    ours = build_model(resolve_source(str(folder)), torch.float32, "meta")
    assert arch.num_parameters() == sum(p.numel() for p in ours.parameters())
    theirs = sum(p.numel() for p in reference(folder, variant).parameters())  # a tied head counted once
    assert arch.num_parameters() == theirs


def kernels_match_pytorch_path(folder: Path, monkeypatch) -> None:
    """Prefills of 9 and 12 tokens (past the 7-token window) and a decode step of both, every kernel on
    and Triton's paged attention, against the PyTorch path on the same model."""
    from overnight.attention.triton_backend import TritonAttentionBackend
    from overnight.kernels import dispatch
    from overnight.kernels.paged_decode import DecodeConfig
    from overnight.kernels.paged_prefill import PrefillConfig
    from tests.kernel_helpers import DEVICE, run_steps

    model = load_model(resolve_source(str(folder)), torch.float32, DEVICE)
    a = model.arch
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = run_steps(model, max_id=a.vocab_size)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    backend = TritonAttentionBackend(
        a.num_attention_heads, a.num_key_value_heads, a.head_dim, max_num_seqs=4, max_model_len=512,
        device=DEVICE, decode_config=DecodeConfig(block_n=16), prefill_config=PrefillConfig(16, 16, 4, 1),
    )  # fmt: skip
    got = run_steps(model, a.vocab_size, backend)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def preset_has_published_shape(
    name: str, layers: int, heads: int, kv_heads: int, head_dim: int, mlp: int, vocab: int, count: int
) -> torch.nn.Module:
    """The preset (dummy weights, on meta) has the published checkpoint's shapes and parameter count,
    ModelArch's count equal to the built model's."""
    source = resolve_source(name, load_format="dummy")
    model = build_model(source, torch.bfloat16, "meta")
    assert sum(p.numel() for p in model.parameters()) == count == source.arch.num_parameters()
    attn = model.model.layers[0].self_attn
    assert (len(model.model.layers), attn.num_heads, attn.num_kv_heads, attn.head_dim) == (
        layers, heads, kv_heads, head_dim,
    )  # fmt: skip
    assert model.model.layers[0].mlp.down_proj.weight.shape[1] == mlp
    assert model.lm_head.weight.shape[0] == vocab
    return model
