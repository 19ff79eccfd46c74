"""LFM2 hybrids (Lfm2ForCausalLM: gated short convs + attention with QK norm).

Tier (a), in seconds: config.json -> ModelArch (every parameter counted as transformers holds it, the
feed-forward width by transformers' own rule, the conv-only state shapes, the older config keys), bad
configs and tensor parallelism refused by name, the published presets, LFM2-MoE's router against
transformers' (tests/test_short_conv_ops.py has the conv ops, torch against Triton).
Tier (c), about a second each (the Triton interpreter's two marked slow): fp32 greedy token-exact with transformers through the LLM API (chunked prefill cut
inside prompts, the Triton path, prefix-cache hits through state snapshots, preemption with a tiny pool,
padded decode batches, decode steps without host syncs)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from overnight import LLM
from overnight.errors import ModelLoadError
from overnight.models.registry import arch_from_hf_config
from tests.kernel_helpers import DEVICE
from tests.tiny_lfm2 import VARIANTS, make_lfm2_checkpoint, make_lfm2_model

ENGINE = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4)


def config_of(variant: str, **overrides) -> tuple[dict, torch.nn.Module]:
    model = make_lfm2_model(variant, **overrides)
    return json.loads(model.config.to_json_string()), model


@pytest.mark.parametrize("variant", ["tied", "biased"])
def test_arch_counts_every_parameter_and_the_state_shapes(variant: str) -> None:
    cfg, model = config_of(variant)
    arch = arch_from_hf_config(cfg)
    assert arch.architecture == "lfm2" and arch.is_short_conv and not arch.is_mamba2
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())
    assert arch.intermediate_size == model.model.layers[0].feed_forward.w1.out_features == 96
    assert arch.tie_word_embeddings == (variant == "tied") and arch.short_conv_bias == (variant == "biased")
    linear, full = "linear_attention", "full_attention"
    assert arch.layer_types == (linear, full, linear, full, linear) and arch.num_linear_layers == 3
    # a conv state of K - 1 = 2 rows of hidden_size, no recurrent state
    assert arch.linear_state_shapes() == ((2, 40), (0, 0, 0))
    assert arch.linear_state_bytes() == arch.linear_state_bytes(torch.bfloat16) == 3 * 4 * 2 * 40
    assert arch.kv_bytes_per_token(4) == 2 * 2 * (2 * 10) * 4  # 2 attention layers, K and V


def test_moe_arch_counts_every_parameter_and_routes_as_transformers() -> None:
    """LFM2-MoE: two dense layers (intermediate_size as given), then experts; expert_bias is a buffer in
    transformers and a parameter of our router, so it is counted on both sides."""
    cfg, model = config_of("moe")
    arch = arch_from_hf_config(cfg)
    assert arch.architecture == "lfm2_moe" and arch.is_short_conv and arch.num_experts == 6
    biases = sum(b.numel() for name, b in model.named_buffers() if name.endswith("expert_bias"))
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters()) + biases
    assert [arch.is_moe_layer(i) for i in range(5)] == [False, False, True, True, True]
    assert arch.intermediate_size == model.model.layers[0].feed_forward.w1.out_features == 36
    assert (arch.router_scoring, arch.routed_scaling_factor, arch.router_renorm_eps) == ("sigmoid", 1.5, 1e-6)
    assert arch.linear_state_shapes() == ((2, 40), (0, 0, 0))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(use_expert_bias=False), "use_expert_bias false is not supported yet"),
        (dict(num_experts_per_tok=7), "num_experts_per_tok 7 must be in 1..num_experts"),
    ],
)
def test_bad_moe_configs_are_refused_by_name(change: dict, message: str) -> None:
    cfg, _ = config_of("moe")
    with pytest.raises(ModelLoadError, match=message):
        arch_from_hf_config({**cfg, **change})


@pytest.mark.parametrize(
    "sizes",
    [
        dict(),  # Lfm2Config's defaults: 2/3 of 12288, a multiple of 256
        dict(intermediate_size=1000, block_multiple_of=64, block_ffn_dim_multiplier=1.3),
        dict(intermediate_size=1000, block_ffn_dim_multiplier=None),  # 2/3, not rounded up (older configs)
        dict(intermediate_size=1000, block_auto_adjust_ff_dim=False),  # as given
        dict(block_ff_dim=4000),  # the older configs' name for intermediate_size
    ],
)
def test_the_feed_forward_width_follows_transformers(sizes: dict) -> None:
    import transformers
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    no_multiplier = "block_ffn_dim_multiplier" in sizes and sizes["block_ffn_dim_multiplier"] is None
    if no_multiplier:
        sizes = {k: v for k, v in sizes.items() if k != "block_ffn_dim_multiplier"}
    cfg = transformers.Lfm2Config(
        hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, **sizes
    )
    if no_multiplier:  # transformers 5 refuses None as an argument, and still reads it in Lfm2MLP
        object.__setattr__(cfg, "block_ffn_dim_multiplier", None)
    with torch.device("meta"):
        width = Lfm2MLP(cfg).w1.out_features
    ours = arch_from_hf_config({**json.loads(cfg.to_json_string()), "architectures": ["Lfm2ForCausalLM"]})
    assert ours.intermediate_size == width


def test_older_config_keys_are_read_as_transformers_reads_them() -> None:
    """full_attn_idxs without layer_types, tie_embedding, block_ff_dim, rope_theta at the top level."""
    cfg, model = config_of("biased")
    for key in ("layer_types", "tie_word_embeddings", "intermediate_size", "rope_parameters"):
        cfg.pop(key)
    cfg.update(full_attn_idxs=[1, 3], tie_embedding=False, block_ff_dim=90, rope_theta=10000.0)
    arch = arch_from_hf_config(cfg)
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())
    assert arch.rope_theta == 10000.0 and not arch.tie_word_embeddings
    assert [arch.is_linear_layer(i) for i in range(5)] == [True, False, True, False, True]
    cfg.pop("rope_theta")
    assert arch_from_hf_config(cfg).rope_theta == 1e6  # Lfm2Config's default theta


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(layer_types=["conv", "mamba", "conv", "full_attention", "conv"]), "layer_types must name 5"),
        (dict(layer_types=["conv"] * 4), "layer_types must name 5"),
        (dict(conv_L_cache=1), "conv_L_cache must be at least 2"),
        (dict(num_attention_heads=3), "hidden_size 40 does not split into 3"),
        (dict(num_key_value_heads=3), "num_key_value_heads 3 must divide num_attention_heads 4"),
        (dict(block_multiple_of=0), "block_multiple_of must be positive"),
    ],
)
def test_bad_configs_are_refused_by_name(change: dict, message: str) -> None:
    cfg, _ = config_of("tied")
    with pytest.raises(ModelLoadError, match=message):
        arch_from_hf_config({**cfg, **change})
    cfg.pop("vocab_size")
    with pytest.raises(ModelLoadError, match="lacks required field 'vocab_size'"):
        arch_from_hf_config(cfg)


def test_tensor_parallelism_is_refused_by_name() -> None:
    from overnight.parallel.tp_shards import TPShards

    cfg, _ = config_of("tied")
    arch = arch_from_hf_config(cfg)
    TPShards(arch, 0, 1).check()
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 2 is not supported yet for LFM2"):
        TPShards(arch, 0, 2).check()


def test_the_published_checkpoint_layout_loads() -> None:
    """save_pretrained's names (operator_norm, feed_forward.w1/w3/w2, self_attn.out_proj, q_layernorm,
    embedding_norm, conv.conv) land in Llama's blocks, every tensor used once."""
    from overnight.models.lfm2 import Lfm2ForCausalLM

    cfg, model = config_of("biased")
    ours = Lfm2ForCausalLM(arch_from_hf_config(cfg))
    ours.load_weights(model.state_dict().items())
    state = model.state_dict()
    params = dict(ours.named_parameters())
    assert torch.equal(params["model.norm.weight"], state["model.embedding_norm.weight"])
    assert torch.equal(params["model.layers.0.conv.conv.weight"], state["model.layers.0.conv.conv.weight"])
    gate_up = params["model.layers.1.mlp.gate_up_proj.weight"]
    w1, w3 = state["model.layers.1.feed_forward.w1.weight"], state["model.layers.1.feed_forward.w3.weight"]
    assert torch.equal(gate_up, torch.cat([w1, w3]))
    assert torch.equal(
        params["model.layers.1.self_attn.q_norm.weight"], state["model.layers.1.self_attn.q_layernorm.weight"]
    )


def test_both_moe_checkpoint_layouts_load() -> None:
    """The published layout (feed_forward.experts.N.w1 / w3 / w2, as save_pretrained writes it) and
    transformers 5's in-memory stacks (experts.gate_up_proj / down_proj) fill the same parameters; the
    expert_bias buffer lands in the router."""
    from overnight.models.lfm2 import Lfm2ForCausalLM

    cfg, model = config_of("moe")
    arch = arch_from_hf_config(cfg)
    stacked = model.state_dict()
    assert "model.layers.2.feed_forward.experts.gate_up_proj" in stacked
    published = {}
    for name, t in stacked.items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                published[name.replace("gate_up_proj", f"{e}.w1.weight")] = gate[e]
                published[name.replace("gate_up_proj", f"{e}.w3.weight")] = up[e]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                published[name.replace("down_proj", f"{e}.w2.weight")] = t[e]
        else:
            published[name] = t
    ours = []
    for weights in (stacked, published):
        m = Lfm2ForCausalLM(arch)
        m.load_weights(weights.items())
        ours.append(dict(m.named_parameters()))
    for name, p in ours[0].items():
        assert torch.equal(p, ours[1][name]), name
    experts = ours[0]["model.layers.3.mlp.experts.gate_up_proj"]
    assert torch.equal(experts, stacked["model.layers.3.feed_forward.experts.gate_up_proj"])
    bias = ours[0]["model.layers.4.mlp.gate.e_score_correction_bias"]
    assert torch.equal(bias, stacked["model.layers.4.feed_forward.expert_bias"]) and bias.abs().sum() > 0


def test_the_router_renormalizes_as_transformers_on_both_paths() -> None:
    """Tiny sigmoid scores (logits near -14: the chosen scores sum to about 1e-6), where the eps of the
    renormalization (1e-6, GLM's is 1e-20) shrinks the weights: the kernel (interpreter) and the
    reference both give transformers' Lfm2MoeTopKRouter weights for its experts."""
    import transformers
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeTopKRouter

    from overnight.kernels.moe_router import grouped_router_topk
    from overnight.layers.moe_grouped_router import GroupedRouting, grouped_router_topk_ref

    gen = torch.Generator().manual_seed(3)
    e, k, h = 8, 3, 16
    cfg = transformers.Lfm2MoeConfig(
        num_experts=e, num_experts_per_tok=k, hidden_size=h, routed_scaling_factor=1.5
    )
    router = Lfm2MoeTopKRouter(cfg)
    x = torch.randn(7, h, generator=gen)
    x[:, -1] = 1.0  # a constant input whose weight shifts every logit to about -14
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, h, generator=gen) / h**0.5)
        router.weight[:, -1] = -14.0
    bias = 0.5 * torch.randn(e, generator=gen)
    logits, expect, chosen = router(x, bias)
    assert (expect.sum(-1) < 1.45).all()  # the eps matters here: without it the weights would sum to 1.5
    routing = GroupedRouting(k, e, renormalize=True, scaling=1.5, renorm_eps=1e-6)
    want = chosen.sort(-1)
    for weights, ids in (
        grouped_router_topk_ref(logits, bias, routing),
        grouped_router_topk(logits.to(DEVICE), bias.to(DEVICE), k, 1, 1, True, 1.5, 1e-6),
    ):
        order = ids.long().cpu().sort(-1).indices
        assert torch.equal(ids.long().cpu().gather(1, order), want.values)
        torch.testing.assert_close(weights.cpu().gather(1, order), expect.gather(1, want.indices))


def _built_parameters(arch) -> int:
    """Parameters of our model class built on the meta device (no memory)."""
    from overnight.models.lfm2 import Lfm2ForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in Lfm2ForCausalLM(arch).parameters())


def test_the_8b_a1b_preset_counts_its_published_sizes() -> None:
    """LiquidAI/LFM2-8B-A1B's config (8.3B parameters, 1.5B active; 18 conv and 6 attention layers at
    2, 6, 10, 14, 18, 21; two dense layers, then 32 experts of 1,792, 4 a token)."""
    from overnight.loader.resolve import resolve_source

    arch = resolve_source("lfm2-8b-a1b", load_format="dummy").arch
    assert arch.architecture == "lfm2_moe" and arch.num_linear_layers == 18
    assert [i for i in range(24) if not arch.is_linear_layer(i)] == [2, 6, 10, 14, 18, 21]
    assert [i for i in range(24) if not arch.is_moe_layer(i)] == [0, 1]
    assert arch.intermediate_size == 7168 and arch.tie_word_embeddings
    assert 8.3e9 < arch.num_parameters() < 8.4e9
    assert arch.num_parameters() == _built_parameters(arch)
    active = arch.num_linear_parameters(active_only=True) + arch.vocab_size * arch.hidden_size
    assert 1.5e9 < active < 1.6e9


def test_the_1_2b_preset_counts_its_published_sizes() -> None:
    """LiquidAI/LFM2-1.2B's config (1.17B parameters; 10 conv layers, attention at 2, 5, 8, 10, 12, 14;
    feed-forward 8192 = 2/3 of block_ff_dim 12288; tied embeddings)."""
    from overnight.loader.resolve import resolve_source

    arch = resolve_source("lfm2-1.2b", load_format="dummy").arch
    assert arch.architecture == "lfm2" and arch.num_linear_layers == 10
    assert [i for i in range(16) if not arch.is_linear_layer(i)] == [2, 5, 8, 10, 12, 14]
    assert arch.intermediate_size == 8192 and arch.tie_word_embeddings and arch.rope_theta == 1e6
    assert (arch.head_dim, arch.num_key_value_heads, arch.rms_norm_eps) == (64, 8, 1e-5)
    assert 1.16e9 < arch.num_parameters() < 1.18e9
    assert arch.num_parameters() == _built_parameters(arch)
    assert arch.linear_state_bytes() == 10 * 4 * 2 * 2048  # two rows of 2,048 float32 per conv layer
    assert arch.kv_bytes_per_token(2) == 6 * 2 * 8 * 64 * 2


# ----------------------------------------------------------------------------- against transformers


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    import transformers

    folder = make_lfm2_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, ref


def test_token_exact_with_chunked_prefill(checkpoint) -> None:
    """Chunks of 24 tokens: the longer prompts are cut inside, mixed with other requests' decodes."""
    from tests.test_hybrid_models import assert_no_rows_held, check, prompts_of

    _, folder, ref = checkpoint
    llm = LLM(str(folder), max_num_batched_tokens=24, max_num_seqs=6, max_model_len=512, **ENGINE)
    check(llm, ref, prompts_of([1, 2, 5, 23, 40, 150], seed=1), 10)
    assert_no_rows_held(llm, 6)


@pytest.mark.slow
def test_token_exact_on_the_triton_path(checkpoint, monkeypatch) -> None:
    """Every layer on its GPU path (conv step without activation, the batched prefill conv, attention
    with the fused QK norm + RoPE, the norms; the sigmoid router kernel and fused MoE), through the
    Triton interpreter."""
    from overnight.kernels import dispatch
    from tests.test_hybrid_models import check, prompts_of

    variant, folder, ref = checkpoint
    if variant == "tied":
        pytest.skip("the interpreter is slow: the biased variant runs every kernel the tied one does")
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    llm = LLM(str(folder), max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128, **ENGINE)
    check(llm, ref, prompts_of([1, 9, 30], seed=2), 6)


def test_shared_prefix_hits_through_state_snapshots(checkpoint) -> None:
    from tests.test_hybrid_models import VOCAB, assert_no_rows_held, check

    variant, folder, ref = checkpoint
    if variant != "tied":
        pytest.skip("snapshots are the conv states: one variant is enough")
    rng = random.Random(5)
    system = [rng.randrange(3, VOCAB) for _ in range(90)]
    first = [system + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (9, 4)]
    second = [system + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (6, 1, 13)]
    llm = LLM(str(folder), max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256, **ENGINE)
    check(llm, ref, first, 6)
    before = llm.engine.stats().prefix_cache_hits  # type: ignore[attr-defined]
    check(llm, ref, second, 6)
    hits = llm.engine.stats().prefix_cache_hits - before  # type: ignore[attr-defined]
    assert hits >= 3 * 88  # every second-wave prompt starts past the system prompt's 22 full blocks
    assert_no_rows_held(llm, 4)


def test_preemption_restarts_from_a_zero_state(checkpoint) -> None:
    from tests.test_engine_parity import hf_greedy
    from tests.test_hybrid_models import assert_no_rows_held, prompts_of, run_engine

    variant, folder, ref = checkpoint
    if variant != "biased":
        pytest.skip("preemption runs on one variant")
    prompts = prompts_of([5, 13, 40, 57, 9, 30, 21], seed=3)
    state_bytes = 3 * 4 * 2 * 40  # a request's conv states: 3 layers x 2 rows x 40 float32
    block_bytes = 4 * 2 * 2 * 10 * 2 * 4  # 4 tokens x (K, V) x 2 heads of 10 x 2 attention layers x fp32
    llm = LLM(
        str(folder),
        kv_cache_memory_bytes=state_bytes * (7 + 1) + 40 * block_bytes,  # max_num_seqs + 1 slots
        max_num_batched_tokens=16,
        max_num_seqs=7,
        max_model_len=128,
        enable_prefix_caching=False,
        admission="greedy",  # start whatever fits now, so that running requests outgrow the pool
        **ENGINE,
    )
    assert llm.engine.pool_plan.num_blocks == 40  # type: ignore[attr-defined]
    for prompt, got in zip(prompts, run_engine(llm, prompts, 24)):
        assert got == hf_greedy(ref, prompt, 24)[0], f"{len(prompt)} tokens"
    assert llm.engine.stats().num_preemptions_total > 0  # type: ignore[attr-defined]
    assert_no_rows_held(llm, 7)


def test_padded_decode_batches_leave_real_states_alone(checkpoint) -> None:
    from tests.test_hybrid_models import check_padded_decodes

    variant, folder, ref = checkpoint
    if variant != "tied":
        pytest.skip("one variant is enough for the padding rows")
    check_padded_decodes(folder, ref)


@pytest.mark.slow
def test_decode_steps_have_no_host_syncs(checkpoint, monkeypatch) -> None:
    """What CUDA-graph capture forbids (tests/sync_guard.py), in float16 with every layer on its GPU
    path: the conv step kernel with its bias, QK-normed attention, the sigmoid router and fused MoE."""
    from tests.test_graph_safety import decode_guarded

    variant, folder, _ = checkpoint
    if variant == "tied":
        pytest.skip("the biased variant covers every kernel the tied one runs")
    decode_guarded(folder, monkeypatch)
