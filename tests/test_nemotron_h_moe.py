"""Nemotron 3 (NemotronHForCausalLM with "E" blocks: a grouped sigmoid router, ungated relu^2 experts and
a shared expert; models/nemotron_h_mlp.py). Tier (a), in seconds, on tiny random models from
transformers' own NemotronHConfig: every parameter counted as transformers holds it; the MoE block and
its router against transformers' modules (with groups that drop experts, and a correction bias that
moves choices); both checkpoint layouts load; online FP8 quantizes the experts per row as they load and
ModelArch.weight_bytes counts what loads; dummy weights; bad configs refused by name; the
nemotron-3-nano-30b-a3b preset's published sizes and its budget on an H100. Tier (c), token-exact
against transformers through the LLM API (torch and Triton paths, chunked prefill, decode steps without
host syncs), is tests/test_mamba2_hybrids.py's "nemotron-3" model."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

from overnight.errors import ModelLoadError
from overnight.layers.moe import Experts
from overnight.loader.model_loader import build_model, load_model
from overnight.loader.resolve import resolve_source
from overnight.models.nemotron_h import NemotronHForCausalLM
from overnight.models.registry import arch_from_hf_config
from overnight.quant.fp8 import quantize_stacked_per_channel
from overnight.quant.linear import Fp8Linear
from tests.tiny_nemotron_h import MOE_PATTERN, make_nemotron_h_moe_checkpoint, make_nemotron_h_moe_model


def config_of(**overrides) -> tuple[dict, torch.nn.Module]:
    model = make_nemotron_h_moe_model(**overrides)
    cfg = json.loads(model.config.to_json_string())
    cfg["architectures"] = ["NemotronHForCausalLM"]
    return cfg, model


def loaded(model: nn.Module, arch) -> NemotronHForCausalLM:
    """Ours, holding `model`'s weights (transformers 5's names: model.*, stacked experts.up_proj)."""
    ours = NemotronHForCausalLM(arch)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    ours.load_weights((k, v.detach()) for k, v in tensors.items())
    return ours.eval()


def test_arch_counts_every_parameter_and_only_the_mixers_are_layers() -> None:
    cfg, model = config_of()
    arch = arch_from_hf_config(cfg)
    assert arch.block_pattern == MOE_PATTERN and (arch.moe_blocks, arch.mlp_blocks) == (3, 1)
    assert arch.layer_types == ("linear_attention", "full_attention") * 2  # M * M *
    assert not any(arch.is_moe_layer(i) for i in range(arch.num_hidden_layers))
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (8, 2, 16)
    assert arch.shared_expert_intermediate_size == 24 and not arch.experts_gated
    assert (arch.router_scoring, arch.routed_scaling_factor, arch.norm_topk_prob) == ("sigmoid", 2.5, True)
    # transformers holds the routers' correction biases as buffers; ours are parameters
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert biases == 3 * 8
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters()) + biases
    ours = NemotronHForCausalLM(arch)
    assert sum(p.numel() for p in ours.parameters()) == arch.num_parameters()
    # a token goes through 2 of the 8 experts: 6 experts of up and down (2 x 32 x 16) less per block
    assert arch.mlp_params() - arch.mlp_params(active_only=True) == 3 * 6 * 2 * 32 * 16


@pytest.mark.parametrize(
    "routing",
    [
        dict(),  # the published one: a single group
        dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3, norm_topk_prob=False),
        dict(moe_latent_size=12),  # Nemotron 3 Super's latent experts
    ],
    ids=["one-group", "4-groups-keep-2", "latent"],
)
def test_the_moe_block_matches_transformers(routing: dict) -> None:
    """Router (choices by score + bias among the kept groups, weights the unbiased scores), experts
    (relu^2, no gate; between the latent projections when latent), shared expert: our block against
    transformers' NemotronHMoE, fp32, and every parameter counted."""
    cfg, model = config_of(**routing)
    arch = arch_from_hf_config(cfg)
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters()) + biases
    ours = loaded(model, arch)
    theirs, mine = model.model.layers[1].mixer, ours.model.layers[1].mixer
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3))
    _, ref_w, ref_ids = theirs.gate(x)
    weights, ids = mine.gate(x)
    order, ref_order = ids.long().sort(dim=-1), ref_ids.sort(dim=-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_w.gather(1, ref_order.indices))
    # the bias moved some choices: the plain top-k of the scores differs somewhere
    plain = torch.sigmoid(x @ theirs.gate.weight.T).topk(ids.shape[1], dim=-1).indices.sort(dim=-1).values
    assert not torch.equal(plain, order.values)
    with torch.no_grad():
        torch.testing.assert_close(mine(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_both_checkpoint_layouts_load(tmp_path) -> None:
    """The published layout (backbone.*, experts.{e}.up_proj / down_proj, as save_pretrained writes it)
    and transformers 5's in-memory one (model.*, stacked experts.up_proj [E, I, H]) fill the same
    parameters; multi-token-prediction tensors (mtp.*) are skipped."""
    from safetensors.torch import load_file

    folder = make_nemotron_h_moe_checkpoint(tmp_path)
    arch = resolve_source(str(folder)).arch
    published = load_file(folder / "model.safetensors")
    assert "backbone.layers.1.mixer.experts.7.up_proj.weight" in published
    published["mtp.layers.0.mixer.gate.weight"] = torch.zeros(8, 32)
    a = NemotronHForCausalLM(arch)
    a.load_weights(published.items())
    _, model = config_of()
    b = loaded(model, arch)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    stack = a.model.layers[4].mixer.experts.gate_up_proj
    assert stack.shape == (8, 16, 32)
    assert torch.equal(stack[5], published["backbone.layers.4.mixer.experts.5.up_proj.weight"])


@pytest.mark.parametrize("latent", [0, 12])
def test_online_fp8_quantizes_experts_per_row_as_they_load(tmp_path, latent: int) -> None:
    """--quantization fp8: the experts are e4m3 from the build on (each checkpoint expert quantized per
    row as it arrives: the bytes of quantizing the float stack), the shared experts, latent, MLP, Mamba2
    and attention projections Fp8Linear, the router float32; what loads is what weight_bytes counts."""
    folder = make_nemotron_h_moe_checkpoint(tmp_path, moe_latent_size=latent or None)
    source = resolve_source(str(folder), quantization="fp8")
    model = load_model(source, torch.float32, "cpu")
    float_model = load_model(resolve_source(str(folder)), torch.float32, "cpu")
    experts, dense = model.model.layers[7].mixer.experts, float_model.model.layers[7].mixer.experts
    assert isinstance(experts, Experts) and experts.stores_fp8
    for name in ("gate_up_proj", "down_proj"):
        data, scale = quantize_stacked_per_channel(getattr(dense, name))
        assert torch.equal(getattr(experts, name).view(torch.uint8), data.view(torch.uint8)), name
        assert torch.equal(getattr(experts, name.replace("_proj", "_scale")), scale), name
    moe = model.model.layers[1].mixer
    assert isinstance(moe.shared_experts.up_proj, Fp8Linear) and isinstance(
        moe.shared_experts.down_proj, Fp8Linear
    )
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert [n for n, m in model.named_modules() if type(m) is nn.Linear] == ["lm_head"]
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    held += sum(
        s.numel() * 4
        for m in model.modules()
        if isinstance(m, Experts)
        for s in (m.gate_up_scale, m.down_scale)
    )
    assert held == source.arch.weight_bytes(4, fp8_linear=True, fp8_experts=True)
    assert float_model.model.layers[1].mixer.experts.gate_up_proj.dtype == torch.float32
    held = sum(t.numel() * t.element_size() for t in float_model.parameters())
    assert held == source.arch.weight_bytes(4)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # e4m3 has no torch.equal


def test_fp8_checkpoint_loads_as_online_fp8(tmp_path) -> None:
    """A per-channel FP8 checkpoint (compressed-tensors; the router float): its expert tensors are
    dequantized with their scales as they load, then quantized per row into the e4m3 stacks (an e4m3
    row requantizes to itself), the shared experts load as Fp8Linear: the model equals online FP8's."""
    from tests.fp8_checkpoints import make_fp8_checkpoint

    src = make_nemotron_h_moe_checkpoint(tmp_path / "src")
    fp8 = make_fp8_checkpoint(src, tmp_path / "fp8", "ct-channel-dynamic")
    model = load_model(resolve_source(str(fp8)), torch.float32, "cpu")
    online = load_model(resolve_source(str(src), quantization="fp8"), torch.float32, "cpu")
    assert isinstance(model.model.layers[4].mixer.shared_experts.down_proj, Fp8Linear)
    ours, theirs = model.state_dict(), online.state_dict()
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        assert torch.equal(_bits(t), _bits(theirs[name])), name
    for block in (1, 4, 7):
        a, b = model.model.layers[block].mixer.experts, online.model.layers[block].mixer.experts
        assert a.stores_fp8 and torch.equal(a.gate_up_scale, b.gate_up_scale)
        assert torch.equal(a.down_scale, b.down_scale)


def test_awq_checkpoint_keeps_the_ungated_experts_dequantized(tmp_path, monkeypatch) -> None:
    """An AWQ checkpoint as a GPU loads it (packed layers kept on the CPU): the packed MoE kernels are
    gated, so the relu^2 experts load dequantized (the values the checkpoint decodes to) while the shared
    experts, MLP, Mamba2 and attention projections stay packed; the pre-load estimate counts that."""
    from overnight.loader.fit import linear_formats, weight_bytes
    from overnight.quant import apply
    from overnight.quant.int_linear import WeightOnlyIntLinear
    from tests.int_checkpoints import make_int_checkpoint
    from tests.test_memory_fit_quantized import _held_bytes

    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    sizes = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=64)
    sizes |= dict(moe_shared_expert_intermediate_size=64, mamba_num_heads=8, mamba_head_dim=8)
    src = make_nemotron_h_moe_checkpoint(tmp_path / "src", **sizes)
    awq, dequantized = make_int_checkpoint(src, tmp_path / "awq", "awq-g32")
    source = resolve_source(str(awq))
    model = load_model(source, torch.float32, "cpu")
    reference = load_model(resolve_source(str(dequantized)), torch.float32, "cpu")
    moe = model.model.layers[4].mixer
    assert type(moe.experts) is Experts and isinstance(moe.shared_experts.up_proj, WeightOnlyIntLinear)
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(moe.experts, name), getattr(reference.model.layers[4].mixer.experts, name))
    fp8, int_linear = linear_formats(source.quantization, "cuda")
    estimate = weight_bytes(source.arch, torch.float32, fp8, True, int_linear, source.quantization)
    assert int_linear is not None and int_linear[2] and estimate == _held_bytes(model)


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_dummy_weights_load_for_a_shrunk_preset(fp8: bool) -> None:
    """Dummy weights (the budget's and benchmarks' load format) fill every parameter, the FP8 experts
    quantized as they are drawn; what loads is what the pre-load estimate counts."""
    from overnight.loader.fit import weight_bytes
    from overnight.quant.scheme import QuantScheme

    preset = resolve_source("nemotron-3-nano-30b-a3b", load_format="dummy")
    arch = replace(
        preset.arch, block_pattern="ME*E", layer_types=("linear_attention", "full_attention"),
        num_hidden_layers=2, no_rope_layers=(0, 1), vocab_size=64, hidden_size=32, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2,
        mamba_norm_groups=2, mamba_d_state=8, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24,
    )  # fmt: skip
    source = replace(preset, arch=arch, quantization=QuantScheme() if fp8 else None)
    model = load_model(source, torch.float32, "cpu", seed=1)
    experts = model.model.layers[1].mixer.experts
    assert experts.gate_up_proj.shape == (8, 16, 32) and experts.stores_fp8 == fp8
    assert experts.gate_up_proj.float().abs().sum() > 0
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    scales = [
        getattr(m, n)
        for m in model.modules()
        if isinstance(m, Experts)
        for n in ("gate_up_scale", "down_scale")
    ]
    held += sum(t.numel() * 4 for t in scales if t is not None)
    assert held == weight_bytes(arch, torch.float32, fp8_linear=fp8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(moe_latent_size=-4), "moe_latent_size must be positive"),
        (dict(n_group=3), "n_group 3 must split num_experts 8"),
        (dict(n_group=2, topk_group=3), r"topk_group must be in 1..n_group \(2\)"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok must be in 1..8"),
        (dict(moe_intermediate_size=0), "must be positive"),
        (dict(mlp_hidden_act="silu"), "mlp_hidden_act 'silu'"),
    ],
)
def test_bad_moe_configs_are_refused_by_name(change: dict, message: str) -> None:
    cfg, _ = config_of()
    with pytest.raises(ModelLoadError, match=message):
        arch_from_hf_config({**cfg, **change})


def test_the_nano_30b_a3b_preset_counts_its_published_sizes() -> None:
    """nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B's config: 52 blocks (23 Mamba2, 23 MoE, 6 attention), 128
    experts of which 6 a token plus a shared one, 31.6B parameters of which 3.6B active (3.5B on the
    model card, which counts without the embeddings' share)."""
    source = resolve_source("nemotron-3-nano-30b-a3b", load_format="dummy")
    arch = source.arch
    assert len(arch.block_pattern) == 52 and (arch.num_linear_layers, arch.num_hidden_layers) == (23, 29)
    assert (arch.moe_blocks, arch.mlp_blocks, arch.num_experts, arch.num_experts_per_tok) == (23, 0, 128, 6)
    assert (arch.moe_intermediate_size, arch.shared_expert_intermediate_size) == (1856, 3712)
    model = build_model(source, torch.bfloat16, "meta")
    total = sum(p.numel() for p in model.parameters())
    assert total == arch.num_parameters() and 31.5e9 < total < 31.7e9
    active = total - arch.mlp_params() + arch.mlp_params(active_only=True)
    assert 3.5e9 < active < 3.65e9
    # a request's states: 23 x (conv 3 x (4,096 + 2 x 8 x 128) float32 + SSM 64 heads x 64 x 128)
    assert arch.linear_state_bytes() == 23 * (4 * 3 * 6144 + 4 * 64 * 64 * 128)
    assert arch.kv_bytes_per_token(2) == 6 * 2 * 2 * 128 * 2  # 6 attention layers, 2 KV heads, K and V


def test_the_nano_30b_a3b_budget_on_an_h100() -> None:
    """`overnight budget`'s arithmetic: 58.8 GiB of bf16 weights (the float32 routers counted as such)
    leave room for dozens of 32K sequences; FP8 halves the weights (e4m3 experts while loading)."""
    from overnight.options import EngineOptions
    from overnight.quant.scheme import QuantScheme
    from overnight.tools.budget import GIB, DeviceMemory, plan_budget

    h100 = DeviceMemory("NVIDIA H100", total_bytes=int(79.1 * GIB), free_bytes=int(78.6 * GIB))
    name = "nemotron-3-nano-30b-a3b"
    source = resolve_source(name, load_format="dummy")
    opts = EngineOptions(model=name, load_format="dummy", dtype="bfloat16", max_model_len=32768)
    bf16 = plan_budget(opts, source, h100)
    assert 58.5 * GIB < bf16.weights_bytes < 59.2 * GIB and bf16.seqs_fit >= 20
    fp8 = plan_budget(replace(opts, quantization="fp8"), replace(source, quantization=QuantScheme()), h100)
    assert 29.5 * GIB < fp8.weights_bytes < 30.5 * GIB and fp8.seqs_fit > bf16.seqs_fit
