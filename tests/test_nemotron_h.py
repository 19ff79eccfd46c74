"""Nemotron-H hybrids (NemotronHForCausalLM: Mamba2, NoPE attention and squared-ReLU MLP blocks, each a
single mixer behind its own norm). Tier (a), in seconds: config.json -> ModelArch (every parameter
counted as transformers holds it, the state and KV shapes of the mixer layers only), the published and
transformers 5 config spellings, bad configs refused by name, the per-group gated norm against
transformers' own, the Nano-9B-v2 preset's sizes. Tier (c), against transformers through the LLM API, is
tests/test_mamba2_hybrids.py (shared with Granite's hybrids)."""

from __future__ import annotations

import json

import pytest
import torch

from overnight.errors import ModelLoadError
from overnight.models.registry import arch_from_hf_config
from tests.tiny_nemotron_h import PATTERN, make_nemotron_h_checkpoint, make_nemotron_h_model


def config_of(**overrides) -> tuple[dict, torch.nn.Module]:
    model = make_nemotron_h_model(**overrides)
    cfg = json.loads(model.config.to_json_string())
    cfg["architectures"] = ["NemotronHForCausalLM"]
    return cfg, model


def test_arch_counts_every_parameter_and_the_mixer_layers() -> None:
    cfg, model = config_of()
    arch = arch_from_hf_config(cfg)
    assert arch.architecture == "nemotron_h" and arch.is_mamba2
    assert arch.block_pattern == PATTERN and arch.mlp_blocks == 3
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())
    # only the mixer blocks are layers: M * M M * M
    assert arch.layer_types == ("linear_attention", "full_attention", "linear_attention") * 2
    assert arch.num_linear_layers == 4 and arch.no_rope_layers == tuple(range(6))
    assert arch.mamba_n_groups == arch.mamba_norm_groups == 2
    # conv: K - 1 = 3 rows of x|B|C (4 heads x 12 + 2 groups x 2 x 8 = 80); SSM: heads x d_head x d_state
    assert arch.linear_state_shapes() == ((3, 80), (4, 12, 8))
    assert arch.linear_state_bytes() == 4 * (4 * 3 * 80 + 4 * 4 * 12 * 8)
    assert arch.kv_bytes_per_token(4) == 2 * 2 * (2 * 8) * 4  # two attention layers, 2 KV heads of 8


def test_tie_word_embeddings_ties_nothing_as_in_transformers() -> None:
    """transformers' NemotronHForCausalLM keeps its own lm_head whatever tie_word_embeddings says."""
    cfg, model = config_of(tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() != model.model.embeddings.weight.data_ptr()
    arch = arch_from_hf_config(cfg)
    assert not arch.tie_word_embeddings
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())


def test_the_published_config_spelling_is_read() -> None:
    """The published configs' hybrid_override_pattern and mamba_* names, as transformers' config class
    takes them (and saves under its own names)."""
    cfg, _ = config_of()
    for name in ("layers_block_type", "n_groups", "conv_kernel", "ssm_state_size", "time_step_limit"):
        cfg.pop(name)
    cfg.update(hybrid_override_pattern=PATTERN, mamba_n_groups=2, mamba_d_conv=4, mamba_d_state=8)
    cfg["mamba_dt_limit"] = [0.0, "inf"]
    cfg["attention_head_dim"] = cfg.pop("head_dim")  # NVIDIA's own configuration class's name
    assert arch_from_hf_config(cfg) == arch_from_hf_config(config_of()[0])
    cfg.pop("attention_head_dim")  # absent: 128, as transformers' default (not hidden / heads)
    assert arch_from_hf_config(cfg).head_dim == 128


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            dict(layers_block_type=None, hybrid_override_pattern="M*X"),
            r"hybrid_override_pattern holds \['X'\]",
        ),
        (dict(layers_block_type=["linear_attention", "conv"]), r"layers_block_type holds \['conv'\]"),
        (dict(layers_block_type=["linear_attention", "mlp"]), "without attention blocks"),
        (dict(mlp_hidden_act="gelu"), "mlp_hidden_act 'gelu'"),
        (dict(n_groups=3), "mamba_num_heads 4 must be a positive multiple of n_groups 3"),
        (dict(conv_kernel=1), "conv_kernel must be at least 2"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(time_step_limit=[0.0, "lots"]), "time_step_limit holds 'lots'"),
    ],
)
def test_bad_configs_are_refused_by_name(change: dict, message: str) -> None:
    cfg, _ = config_of()
    with pytest.raises(ModelLoadError, match=message):
        arch_from_hf_config({**cfg, **change})


def test_the_gated_norm_is_per_group_as_transformers() -> None:
    """Zamba2RMSNormGated (Nemotron-H's) with group_size = width / n_groups, against ours; and the
    per-group result differs from the whole-width one, so the test can tell them apart."""
    from transformers.models.zamba2.modeling_zamba2 import Zamba2RMSNormGated

    from overnight.layers.mamba2 import MambaGatedRMSNorm

    gen = torch.Generator().manual_seed(0)
    y, z = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    y[:, :24] *= 4.0  # the groups' scales differ
    ref = Zamba2RMSNormGated(48, group_size=24, eps=1e-5)
    ours = MambaGatedRMSNorm(48, 1e-5, groups=2)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(48, generator=gen) + 0.5)
        ours.weight.copy_(ref.weight)
    torch.testing.assert_close(ours(y, z), ref(y, z), rtol=1e-6, atol=1e-6)
    whole = MambaGatedRMSNorm(48, 1e-5)
    whole.load_state_dict(ours.state_dict())
    assert not torch.allclose(whole(y, z), ref(y, z), atol=1e-3)
    with pytest.raises(ValueError, match="does not split into 5 groups"):
        MambaGatedRMSNorm(48, 1e-5, groups=5)


def test_the_published_checkpoint_prefix_loads() -> None:
    """The published checkpoints name the decoder backbone.*; transformers 5 saves model.*."""
    from overnight.models.nemotron_h import NemotronHForCausalLM

    cfg, model = config_of()
    arch = arch_from_hf_config(cfg)
    state = model.state_dict()
    published = {k.replace("model.", "backbone.", 1): v for k, v in state.items()}
    ours = NemotronHForCausalLM(arch)
    ours.load_weights(published.items())
    params = dict(ours.named_parameters())
    assert torch.equal(
        params["model.layers.1.mixer.conv1d.weight"], state["model.layers.1.mixer.conv1d.weight"]
    )
    assert torch.equal(
        params["model.layers.3.mixer.up_proj.weight"], state["model.layers.3.mixer.up_proj.weight"]
    )
    q = state["model.layers.2.mixer.q_proj.weight"]
    assert torch.equal(params["model.layers.2.mixer.qkv_proj.weight"][: q.shape[0]], q)


def test_the_nano_9b_v2_preset_counts_its_published_sizes() -> None:
    """nvidia/NVIDIA-Nemotron-Nano-9B-v2's config: 56 blocks (27 Mamba2, 4 attention, 25 MLP), 8.9B
    parameters, 8 B/C groups."""
    from overnight.loader.resolve import resolve_source

    arch = resolve_source("nemotron-nano-9b-v2", load_format="dummy").arch
    assert arch.architecture == "nemotron_h" and len(arch.block_pattern) == 56
    assert (arch.num_linear_layers, arch.num_hidden_layers, arch.mlp_blocks) == (27, 31, 25)
    assert arch.mamba_norm_groups == 8 and not arch.tie_word_embeddings
    assert 8.8e9 < arch.num_parameters() < 9.0e9
    # a request's states: 27 x (conv 3 x (10,240 + 2 x 8 x 128) float32 + SSM 128 heads x 80 x 128)
    assert arch.linear_state_bytes() == 27 * (4 * 3 * 12288 + 4 * 128 * 80 * 128)
    assert arch.kv_bytes_per_token(2) == 4 * 2 * 8 * 128 * 2  # 4 attention layers, K and V


def test_online_fp8_quantizes_every_block_and_counts_its_bytes(tmp_path) -> None:
    """--quantization fp8: the Mamba2 in/out projections, attention and the MLP blocks become Fp8Linear
    (the LM head stays), and ModelArch.weight_bytes (what the memory plan reserves) is what loads."""
    from torch import nn

    from overnight.loader.model_loader import load_model
    from overnight.loader.resolve import resolve_source
    from overnight.quant.linear import Fp8Linear

    source = resolve_source(str(make_nemotron_h_checkpoint(tmp_path)), quantization="fp8")
    model = load_model(source, torch.float32, "cpu")
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    by_kind = {"M": {"in_proj", "out_proj"}, "*": {"qkv_proj", "o_proj"}, "-": {"up_proj", "down_proj"}}
    want = {f"model.layers.{i}.mixer.{p}" for i, c in enumerate(PATTERN) for p in by_kind[c]}
    assert fp8 == want
    assert [n for n, m in model.named_modules() if type(m) is nn.Linear] == ["lm_head"]
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert held == source.arch.weight_bytes(4, fp8_linear=True)


def test_nano_v2_reasoning_switch_reads_with_the_think_parser() -> None:
    """Nano v2's template ends the prompt with an open `<think>` block (/think, the default) or an empty
    one (/no_think): the qwen3 parser decides from the prompt which the output starts in."""
    from overnight.reasoning import get_reasoning_parser

    parser = get_reasoning_parser("qwen3")
    on, off = "<SPECIAL_11>Assistant\n<think>\n\n", "<SPECIAL_11>Assistant\n<think></think>"
    assert parser.starts_in_reasoning(on) and not parser.starts_in_reasoning(off)
    assert parser.split("Add them.\n</think>\n\n5", starts_in_reasoning=True) == ("Add them.", "5")
    assert parser.split("5", starts_in_reasoning=False) == (None, "5")
    assert parser.closed_in_prompt(off) and not parser.closed_in_prompt(on)
