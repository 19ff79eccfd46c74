"""The dense families of issue 32 end to end on the CPU: the engine (LLM, fp32, greedy) against
transformers, token-exact, on tiny random checkpoints of every architecture (tests/tiny_families.py).

Each engine runs with prefix caching, a tiny max_num_batched_tokens and a KV pool too small for the
whole batch, so one run covers:
  - prompts longer than the window (7 tokens) of the windowed families;
  - prompts sharing a prefix longer than the window, the second round hitting the prefix cache;
  - chunked prefills whose chunk edges cross the window's edge;
  - preemption (asserted through the scheduler's counter), the preempted requests recomputed.
A first divergence counts as agreement only at a near-tie of transformers' logits (top-2 gap < 1e-4),
and comparison stops there (the two continuations differ from then on); at most one sequence of a
family may end so (none did when this was written). LongRoPE (Phi-3) is compared with transformers' model
stepping through its cache (see _hf_greedy and layers/rotary.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.layers.rotary import rope_type_of
from overnight.loader.model_loader import build_model, load_model
from overnight.loader.resolve import resolve_source
from overnight.models.layer_spec import LayerSpec, layer_specs
from overnight.models.registry import arch_from_hf_config
from tests.test_models import PagedCache
from tests.tiny_families import VARIANTS, WINDOW, load_family_reference, make_family_checkpoint

NEW_TOKENS = 10
BLOCK = 4
NEAR_TIE = 1e-4


def _prompts(vocab: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two rounds: the first has a prefix of 3 * WINDOW tokens computed once; the second shares it."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefix = toks(3 * WINDOW)
    first = [toks(29), prefix + toks(5), toks(3)]
    second = [prefix + toks(9), prefix + toks(2), toks(12)]
    return first, second


def _hf_greedy(ref, prompt: list[int], stepwise: bool) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and logits. stepwise: the model itself over its cache, a token a step
    (for LongRoPE: Phi-3's generate() recomputes the cache with the long factors once a sequence crosses
    the original context, where the engine keeps each position's rotation; see layers/rotary.py)."""
    if stepwise:
        tokens, scores = [], []
        with torch.inference_mode():
            out = ref(torch.tensor([prompt]), use_cache=True)
            for step in range(NEW_TOKENS):
                scores.append(out.logits[0, -1])
                tokens.append(int(scores[-1].argmax()))
                if step + 1 < NEW_TOKENS:
                    pos = torch.tensor([[len(prompt) + step]])
                    out = ref(
                        torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, position_ids=pos
                    )
        return tokens, scores
    with torch.inference_mode():
        out = ref.generate(
            torch.tensor([prompt]),
            eos_token_id=[],
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt) :].tolist(), [s[0] for s in out.scores]


def _agree(ours: list[int], theirs: list[int], scores: list[torch.Tensor]) -> tuple[bool, bool]:
    """(agree, at a near-tie): equal tokens, or equal up to a step where transformers' two best logits
    are within NEAR_TIE and ours picked the runner-up."""
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            top2 = scores[step].topk(2)
            tie = float(top2.values[0] - top2.values[1]) < NEAR_TIE and a in top2.indices.tolist()
            return tie, tie
    return len(ours) == len(theirs), False


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    folder = make_family_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, folder


def test_engine_matches_transformers(variant):
    name, folder = variant
    arch = resolve_source(str(folder)).arch
    ref = load_family_reference(folder, name)
    first, second = _prompts(arch.vocab_size, seed=len(name))
    if arch.sliding_window is not None:
        assert arch.sliding_window == WINDOW and max(map(len, first)) > 3 * WINDOW
    if rope_type_of(arch.rope_scaling_dict()) == "longrope":  # prompts within the original context only
        assert (
            max(map(len, first + second)) <= dict(arch.rope_scaling or ())["original_max_position_embeddings"]
        )
    # A pool of 12 blocks: one request (at most 40 tokens) fits, the three of a round do not. Where every
    # layer is windowed a request holds only its window's blocks (engine/kv_groups.py): 7 blocks then.
    windowed_only = arch.layer_types and all(t == "sliding_attention" for t in arch.layer_types)
    pool_tokens = (7 if windowed_only else 12) * BLOCK
    llm = LLM(
        str(folder),
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=48,
        max_num_batched_tokens=11,  # chunks of <= 11 tokens: edges cross the 7-token window
        enable_prefix_caching=True,
        kv_cache_memory_bytes=pool_tokens * arch.kv_bytes_per_token(4),
        admission="greedy",  # start whatever fits now, so that running requests outgrow the pool
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    ties = 0
    for round_idx, prompts in enumerate((first, second)):
        hits_before = llm.engine.kv.prefix_hits
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            expected, scores = _hf_greedy(
                ref, prompt, stepwise=rope_type_of(arch.rope_scaling_dict()) == "longrope"
            )
            ok, tie = _agree(out.outputs[0].token_ids, expected, scores)
            assert ok, f"{name}: prompt of {len(prompt)} tokens: {out.outputs[0].token_ids} != {expected}"
            ties += tie
        if round_idx == 1:  # the shared prefix's full blocks came from the cache
            hits = llm.engine.kv.prefix_hits - hits_before
            if arch.sliding_window is None:
                assert hits >= 2 * (3 * WINDOW // BLOCK) * BLOCK
            elif not windowed_only:  # window blocks go back to this 12-block pool as windows pass
                assert hits >= 2 * BLOCK
            # windowed only: the 7-block pool recycles the prefix's window blocks before the second round
            # (hits with windows: tests/test_kv_cache_windows*.py)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert ties <= 1, f"{name}: {ties} sequences ended at near-ties"


def test_parameter_count_matches_the_checkpoint(variant):
    """ModelArch.num_parameters (the memory check's and `overnight budget`'s count) against the model
    built from it and against transformers' (Mistral 3's vision tower and projector included)."""
    name, folder = variant
    arch = resolve_source(str(folder)).arch
    ours = build_model(resolve_source(str(folder)), torch.float32, "meta")
    assert arch.num_parameters() == sum(p.numel() for p in ours.parameters())
    ref = load_family_reference(folder, name)
    theirs = sum(p.numel() for p in ref.model.parameters()) + ref.lm_head.weight.numel()
    assert arch.num_parameters() == theirs


def test_layer_descriptions_follow_the_configs(tmp_path):
    def specs(variant: str) -> list[LayerSpec]:
        return layer_specs(resolve_source(str(make_family_checkpoint(tmp_path, variant))).arch)

    smol = specs("smollm3")  # layer 1: no RoPE, and (use_sliding_window) the windowed one
    assert [s.rope is None for s in smol] == [False, True, False]
    assert [s.attention.sliding_window for s in smol] == [None, WINDOW, None]
    olmo3 = specs("olmo3")  # sliding layers: their own plain RoPE; the full layer: YaRN
    assert [s.attention.sliding_window for s in olmo3] == [WINDOW, None, WINDOW]
    assert olmo3[0].rope == olmo3[2].rope and olmo3[0].rope and olmo3[0].rope.scaling is None
    assert olmo3[1].rope and dict(olmo3[1].rope.scaling or ())["rope_type"] == "yarn"
    glm4 = specs("glm4")[0].rope
    assert glm4 and glm4.rotary_dim == 6 and glm4.interleaved
    phi3 = specs("phi3")[0].rope
    assert phi3 and phi3.rotary_dim == 6 and not phi3.interleaved


# Published shapes: (layers, hidden, q heads, kv heads, head_dim, MLP, vocab, parameters).
PRESETS = {
    "mistral-small-24b": (40, 5120, 32, 8, 128, 32768, 131072, 23_572_403_200),
    "phi-4": (40, 5120, 40, 10, 128, 17920, 100352, 14_659_507_200),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dummy_presets_have_published_shapes(name):
    layers, hidden, heads, kv_heads, head_dim, mlp, vocab, count = PRESETS[name]
    source = resolve_source(name, load_format="dummy")
    model = build_model(source, torch.bfloat16, "meta")
    assert sum(p.numel() for p in model.parameters()) == count == source.arch.num_parameters()
    attn = model.model.layers[0].self_attn
    assert (len(model.model.layers), attn.num_heads, attn.num_kv_heads, attn.head_dim) == (
        layers,
        heads,
        kv_heads,
        head_dim,
    )
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * mlp, hidden)
    assert model.lm_head.weight.shape == (vocab, hidden)


def _cfg(**extra):
    base = dict(
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    return {**base, **extra}


@pytest.mark.parametrize(
    "cfg,match",
    [
        (_cfg(rope_scaling={"type": "longrope", "short_factor": [1.0] * 4}), "longrope.*missing long_factor"),
        (_cfg(partial_rotary_factor=0.375), "partial_rotary_factor 0.375"),
        (
            _cfg(rope_scaling={"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 4}),
            "bad RoPE parameters.*short_factor must have 4 entries",
        ),
        (_cfg(rope_scaling={"rope_type": "linear"}), "linear RoPE scaling is missing factor"),
        (_cfg(rope_scaling={"rope_type": "mrope", "factor": 2.0}), "unsupported RoPE scaling type 'mrope'"),
        (
            _cfg(
                architectures=["Olmo3ForCausalLM"],
                model_type="olmo3",
                sliding_window=4,
                layer_types=["x", "y"],
            ),
            "layer_types",
        ),
        (
            _cfg(architectures=["Mistral3ForConditionalGeneration"], model_type="mistral3"),
            "lacks required field 'text_config'",
        ),
        (
            {"architectures": ["Mistral3ForConditionalGeneration"], "text_config": {"model_type": "qwen2"}},
            "unsupported text model 'qwen2'",
        ),
        (
            _cfg(
                architectures=["MixtralForCausalLM"],
                model_type="mixtral",
                num_local_experts=2,
                num_experts_per_tok=3,
            ),
            "num_experts_per_tok",
        ),
    ],
)
def test_bad_configs_are_refused(cfg, match):
    with pytest.raises(ModelLoadError, match=match):
        arch_from_hf_config(cfg)


@pytest.mark.parametrize("name", ["glm4", "olmo2"])
def test_forward_with_kernels_matches_pytorch_path(name, tmp_path, monkeypatch):
    """The small-op kernels (RMSNorm, partial / interleaved RoPE) in these families' blocks against the
    PyTorch path (attention: the torch backend either way); compiled on a GPU, through the Triton
    interpreter on the CPU. Model and cache sit on DEVICE: a kernel cannot read a CPU tensor on a GPU host."""
    from overnight.kernels import dispatch
    from tests.kernel_helpers import DEVICE

    folder = make_family_checkpoint(tmp_path, name)
    model = load_model(resolve_source(str(folder)), torch.float32, DEVICE)
    prompt = list(range(5, 5 + 3 * WINDOW))

    def run() -> torch.Tensor:
        cache = PagedCache(model.arch, device=DEVICE)
        (prefill,) = cache.step(model, [("a", prompt)])
        (decode,) = cache.step(model, [("a", [int(prefill[-1].argmax())])], num_decodes=1)
        return torch.cat([prefill, decode])

    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = run()
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    got = run()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * max(1.0, float(expected.abs().max())))


def test_mixtral_online_fp8_quantizes_the_experts_and_keeps_the_router(tmp_path):
    from torch import nn

    from overnight.quant.linear import Fp8Linear

    folder = make_family_checkpoint(tmp_path, "mixtral")
    model = load_model(resolve_source(str(folder), quantization="fp8"), torch.float32, "cpu")
    plain = load_model(resolve_source(str(folder)), torch.float32, "cpu")
    moe, arch = model.model.layers[0].mlp, model.arch
    assert type(moe.gate) is nn.Linear and isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert moe.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert moe.experts.gate_up_scale.shape == (arch.num_experts, 2 * arch.moe_intermediate_size)
    # Dequantized, the experts are the float model's within e4m3's rounding (3 mantissa bits).
    moe.experts.dequantize_()
    ref = plain.model.layers[0].mlp.experts.gate_up_proj
    assert (moe.experts.gate_up_proj - ref).abs().max() <= 2**-4 * ref.abs().max()


@pytest.mark.parametrize("name,theirs", [("mixtral", "block_sparse_moe"), ("mistral3", "language_model")])
def test_checkpoint_names_are_renamed_before_fp8_and_sharding(name, theirs, tmp_path):
    """Mixtral's and Mistral 3's own tensor names become the usual ones in the checkpoint stream itself,
    where FP8 conversion and tensor-parallel slicing read them (Mistral 3's vision tower and projector
    under the model's vision_tower.* / multi_modal_projector.*)."""
    from overnight.loader.model_loader import checkpoint_weights

    source = resolve_source(str(make_family_checkpoint(tmp_path, name)))
    model = build_model(source, torch.float32, "meta")
    names = [n for n, _ in checkpoint_weights(source, model, "cpu")]
    assert names and not [n for n in names if theirs in n]
    towers = [n for n in names if "vision" in n or "projector" in n]
    assert all(n.startswith(("vision_tower.", "multi_modal_projector.")) for n in towers)
    assert bool(towers) == (name == "mistral3")
    expected = "model.layers.0.mlp.experts.3.down_proj.weight" if name == "mixtral" else "lm_head.weight"
    assert expected in names


@pytest.mark.parametrize("name", ["phi3", "glm4", "mixtral", "olmo2"])
def test_tensor_parallel_shards_of_renamed_and_fused_checkpoints(name, tmp_path):
    """Loading rank by rank (each checkpoint tensor sliced as it streams) gives each rank what slicing the
    whole loaded model gives: Phi-3's and GLM-4's fused tensors, Mixtral's renamed experts and OLMo's whole q/k norms included."""
    from overnight.parallel.tp import apply_tp
    from overnight.parallel.tp_load import load_sharded_model

    source = resolve_source(str(make_family_checkpoint(tmp_path, name)))
    for rank in range(2):
        whole = apply_tp(load_model(source, torch.float32, "cpu"), rank, 2)
        streamed = load_sharded_model(source, torch.float32, "cpu", rank, 2)
        a, b = dict(whole.named_parameters()), dict(streamed.named_parameters())
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["phi3", "glm4"])
def test_fused_checkpoints_load_with_online_fp8(name, tmp_path):
    """Phi-3's fused qkv_proj / gate_up_proj and GLM-4's gate_up_proj are split before online FP8 sees
    them (rename_checkpoint), so each fused parameter gets e4m3 rows with per-row scales that dequantize
    to the float model's weights within e4m3's rounding."""
    from overnight.quant.linear import Fp8Linear

    folder = make_family_checkpoint(tmp_path, name)
    model = load_model(resolve_source(str(folder), quantization="fp8"), torch.float32, "cpu")
    plain = load_model(resolve_source(str(folder)), torch.float32, "cpu")
    for module in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        fp8 = model.model.layers[0].get_submodule(module)
        ref = plain.model.layers[0].get_submodule(module).weight
        assert isinstance(fp8, Fp8Linear) and fp8.weight.dtype == torch.float8_e4m3fn
        dequantized = fp8.weight.float() * fp8.weight_scale.view(-1, 1)
        assert (dequantized - ref).abs().max() <= 2**-4 * ref.abs().max()
