"""Granite 4.0 hybrids (GraniteMoeHybridForCausalLM: Mamba2 + attention layers, dense or MoE with the
shared MLP). Tier (a), in seconds: config.json -> ModelArch (every parameter counted as transformers
holds it, the state shapes and bytes the pool plan reserves, the runner's state cache allocating that
plan), bad configs refused by name. Tier (c), against transformers through the LLM API, is
tests/test_mamba2_hybrids.py (shared with Nemotron-H)."""

from __future__ import annotations

import json

import pytest
import torch

from overnight.errors import ModelLoadError
from overnight.models.registry import arch_from_hf_config
from tests.tiny_granite import VARIANTS, make_granite_checkpoint, make_granite_model

ENGINE = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4)


def config_of(variant: str) -> dict:
    model = make_granite_model(variant)
    return json.loads(model.config.to_json_string()), model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_arch_counts_every_parameter_and_the_state_shapes(variant: str) -> None:
    cfg, model = config_of(variant)
    arch = arch_from_hf_config(cfg)
    assert arch.architecture == "granitemoehybrid" and arch.is_mamba2
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())
    assert arch.no_rope_layers == (() if cfg["position_embedding_type"] == "rope" else (0, 1, 2, 3))
    if variant == "attention-only":
        assert arch.num_linear_layers == 0 and arch.kv_bytes_per_token(4) == 4 * 2 * (2 * 8) * 4
        return
    assert arch.layer_types == ("linear_attention", "full_attention") * 2
    assert arch.num_linear_layers == 2 and arch.mamba_dt_limit == (0.0, float("inf"))
    # conv: K - 1 = 3 rows of x|B|C (4 heads x 16 + 2 groups x 2 x 8 = 96); SSM: heads x d_head x d_state
    assert arch.linear_state_shapes() == ((3, 96), (4, 16, 8))
    ssm32, ssm16 = 4 * 4 * 16 * 8, 2 * 4 * 16 * 8
    assert arch.linear_state_bytes() == 2 * (4 * 3 * 96 + ssm32)
    assert arch.linear_state_bytes(torch.bfloat16) == 2 * (4 * 3 * 96 + ssm16)
    # the KV cache: only the two attention layers (2 KV heads of 8)
    assert arch.kv_bytes_per_token(4) == 2 * 2 * (2 * 8) * 4


def test_the_runner_allocates_the_planned_mamba2_states(tmp_path) -> None:
    from overnight.build import build_config
    from overnight.engine.pool_plan import plan_states
    from overnight.loader.resolve import resolve_source
    from overnight.options import EngineOptions
    from overnight.runner.model_runner import ModelRunner

    folder = make_granite_checkpoint(tmp_path, "dense")
    opts = EngineOptions(
        model=str(folder),
        load_format="dummy",
        max_num_seqs=8,
        max_model_len=256,
        kv_cache_memory_bytes=1 << 20,
        mamba_ssm_cache_dtype="bfloat16",
        **ENGINE,
    )
    source = resolve_source(str(folder), "dummy")
    config = build_config(opts, source, torch.device("cpu"), None)
    runner = ModelRunner(config, source)
    plan = plan_states(config.model.arch, config.scheduler, config.cache)
    assert (plan.slots, plan.snapshots, plan.ssm_dtype) == (9, 4, torch.bfloat16)
    cache = runner.state_cache
    assert [tuple(c.shape) for c in cache.conv] == [(9, 3, 96)] * 2
    assert [(tuple(s.shape), s.dtype) for s in cache.ssm] == [((9, 4, 16, 8), torch.bfloat16)] * 2
    assert cache.nbytes == plan.total_bytes == 13 * 2 * (4 * 3 * 96 + 2 * 4 * 16 * 8)
    assert runner.kv_pool_share()[0] == (1 << 20) - plan.total_bytes


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(mamba_d_head=12), "mamba_n_heads 4 x mamba_d_head 12"),
        (dict(mamba_n_groups=3), "mamba_n_groups 3"),
        (dict(layer_types=["mamba", "conv", "mamba", "attention"]), "layer_types must name 4 layers"),
        (dict(position_embedding_type="alibi"), "position_embedding_type 'alibi'"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(mamba_d_conv=1), "mamba_d_conv must be at least 2"),
        (dict(time_step_limit=[0.0, "lots"]), "time_step_limit holds 'lots'"),
    ],
)
def test_bad_configs_are_refused_by_name(change: dict, message: str) -> None:
    cfg, _ = config_of("dense")
    with pytest.raises(ModelLoadError, match=message):
        arch_from_hf_config({**cfg, **change})


def test_published_layer_names_and_limits_are_read() -> None:
    """The published configs' "mamba" / "attention" names (layers_block_type in older ones) and a
    time_step_limit as transformers 5 writes infinity."""
    cfg, _ = config_of("moe")
    cfg.pop("layer_types")
    cfg["layers_block_type"] = ["mamba", "attention", "attention", "mamba"]
    cfg["time_step_limit"] = [0.001, {"__float__": "Infinity"}]
    arch = arch_from_hf_config(cfg)
    assert arch.layer_types == ("linear_attention", "full_attention", "full_attention", "linear_attention")
    assert arch.mamba_dt_limit == (0.001, float("inf"))


def test_both_checkpoint_layouts_load() -> None:
    """The published layout (block_sparse_moe.input_linear / output_linear / router.layer, as
    save_pretrained writes it) and transformers 5's in-memory names (experts.gate_up_proj / down_proj,
    router.weight) fill the same parameters."""
    from overnight.models.granite_hybrid import GraniteMoeHybridForCausalLM

    cfg, model = config_of("moe")
    arch = arch_from_hf_config(cfg)
    state = model.state_dict()
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in state  # transformers 5's names
    published = {
        k.replace("experts.gate_up_proj", "input_linear.weight")
        .replace("experts.down_proj", "output_linear.weight")
        .replace("router.weight", "router.layer.weight"): v
        for k, v in state.items()
    }
    ours = []
    for weights in (state, published):
        m = GraniteMoeHybridForCausalLM(arch)
        m.load_weights(weights.items())
        ours.append(dict(m.named_parameters()))
    for name, p in ours[0].items():
        assert torch.equal(p, ours[1][name]), name
    experts = ours[0]["model.layers.2.block_sparse_moe.experts.gate_up_proj"]
    assert torch.equal(experts, state["model.layers.2.block_sparse_moe.experts.gate_up_proj"])
    assert torch.equal(ours[0]["model.layers.0.mamba.conv1d.bias"], state["model.layers.0.mamba.conv1d.bias"])


def test_the_h_small_preset_counts_its_published_sizes() -> None:
    """ibm-granite/granite-4.0-h-small's config (32.2B parameters, 9B active; 36 Mamba2 layers, 4 NoPE
    attention layers at 5, 15, 25, 35; tied embeddings)."""
    from overnight.loader.resolve import resolve_source

    arch = resolve_source("granite-4.0-h-small", load_format="dummy").arch
    assert arch.architecture == "granitemoehybrid" and arch.num_linear_layers == 36
    assert [i for i in range(40) if not arch.is_linear_layer(i)] == [5, 15, 25, 35]
    assert arch.no_rope_layers == tuple(range(40)) and arch.tie_word_embeddings
    assert 32.1e9 < arch.num_parameters() < 32.3e9
    # a request's states: 36 x (conv 3 x 8,448 float32 + SSM 128 heads x 64 x 128)
    assert arch.linear_state_bytes() == 36 * (4 * 3 * 8448 + 4 * 128 * 64 * 128)
    assert arch.linear_state_bytes(torch.bfloat16) == 36 * (4 * 3 * 8448 + 2 * 128 * 64 * 128)
    assert arch.kv_bytes_per_token(2) == 4 * 2 * 8 * 128 * 2  # 4 attention layers, K and V
