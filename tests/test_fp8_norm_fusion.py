"""The hybrids' norms (layers/norm.py OffsetRMSNorm) under FP8 hand their output to the FP8 projections
already quantized, as Llama's RMSNorm does (quant/apply.py, models/qwen3_next.py LINEAR_INPUT_PRODUCERS):
only a QuantizedActivation where every reader is an Fp8Linear (a full-attention layer's input norm, a
dense MLP's post-attention norm), both forms where a reader stays in the compute dtype (a Gated DeltaNet
layer's input norm before the bf16 b / a projections, a MoE layer's before the router and experts).

On the CPU the fused quantization is the arithmetic the Fp8Linear applies to an unquantized input, so
the fused model's log-probabilities equal those of the same model with its producers unfused, to fp32
rounding; and the fused path is taken (forward hooks see QuantizedActivations leave the norms).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from overnight.layers.norm import OffsetRMSNorm
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from overnight.quant.apply import quantize_model
from overnight.quant.fp8 import QuantizedActivation
from overnight.quant.linear import Fp8Linear
from overnight.quant.scheme import QuantScheme
from tests.parity_helpers import logprobs
from tests.test_fp8_hybrid import FAMILIES, PROMPTS, make_float_checkpoint, make_fp8_hybrid_checkpoint


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-fusion")
    made = {variant: make_float_checkpoint(root / "float", variant) for variant in FAMILIES}
    made["qwen3_next-fp8"] = make_fp8_hybrid_checkpoint(made["qwen3_next"], root / "qwen3_next-fp8")
    return made


def expected_flags(layer: nn.Module) -> tuple[tuple[bool, bool], tuple[bool, bool]]:
    """((fp8, dense) of the input norm, (fp8, dense) of the post-attention norm) of a decoder layer."""
    moe = hasattr(layer.mlp, "experts")
    return (True, layer.linear_attn is not None), (True, moe)


def unfused(model: nn.Module) -> nn.Module:
    """A copy whose producers hand over plain tensors (each Fp8Linear quantizes its input itself)."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if hasattr(module, "fp8_output"):
            module.fp8_output = False
    return twin


@pytest.mark.parametrize("name", [*FAMILIES, "qwen3_next-fp8"])
def test_fused_norms_match_the_unfused_model(folders, name):
    variant = name.removesuffix("-fp8")
    quantization = None if name.endswith("-fp8") else "fp8"
    model = load_model(resolve_source(str(folders[name]), quantization=quantization), torch.float32, "cpu")
    reference = unfused(model)  # before the hooks go on
    seen: dict[str, list[bool]] = {}
    for i, layer in enumerate(model.model.layers):
        for norm, (fp8, dense) in zip(
            (layer.input_layernorm, layer.post_attention_layernorm), expected_flags(layer)
        ):
            assert isinstance(norm, OffsetRMSNorm)
            assert (norm.fp8_output, norm.dense_output) == (fp8, dense), (i, norm)

            def hook(module, args, out, key=f"{i}.{id(norm)}", dense=dense):
                out = out[0] if isinstance(out, tuple) else out
                assert isinstance(out, QuantizedActivation)
                assert (out.dense is not None) == dense
                seen.setdefault(key, []).append(True)

            norm.register_forward_hook(hook)
        if variant == "qwen3_5":
            assert layer.mlp.act_fn.fp8_output  # SiLU-and-mul before the FP8 down_proj, as Llama's
    assert not model.model.norm.fp8_output  # before the LM head, which stays in the compute dtype
    got, want = logprobs(model, PROMPTS[:6]), logprobs(reference, PROMPTS[:6])
    assert len(seen) == 2 * len(model.model.layers)  # every fused norm ran
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_layer_with_a_float_projection_is_not_fused(folders):
    """An ignore list keeping one of q / k / v float: that layer's input norm hands over plain tensors
    (its consumers are not all FP8); the other layers are unaffected."""
    from overnight.models.registry import arch_from_hf_config, model_class_for

    arch = arch_from_hf_config(json.loads((folders["qwen3_5_moe"] / "config.json").read_text()))
    with torch.device("meta"):
        model = model_class_for(arch)(arch)
    quantize_model(model, QuantScheme(ignore=("model.layers.1.self_attn.k_proj",)))
    attention = model.model.layers[1]
    assert type(attention.self_attn.k_proj) is nn.Linear and isinstance(attention.self_attn.q_proj, Fp8Linear)
    assert not attention.input_layernorm.fp8_output and not attention.input_layernorm.dense_output
    assert attention.post_attention_layernorm.fp8_output and attention.post_attention_layernorm.dense_output
    deltanet = model.model.layers[0]
    assert deltanet.input_layernorm.fp8_output and deltanet.input_layernorm.dense_output


@pytest.mark.parametrize("dense", [False, True])
def test_the_kernel_path_hands_over_the_reference_forms(monkeypatch, dense):
    """OffsetRMSNorm's GPU branch (kernels/rmsnorm.py's offset form, here in the Triton interpreter,
    its fp8 casts made exact) hands over what the CPU branch does: the same residual, rows within fp32
    rounding (rsqrt and the sum's order), codes within one e4m3 step. Both branches run on DEVICE: the
    compiled kernel on a GPU host (it cannot read CPU tensors), the interpreter on the CPU."""
    from overnight.kernels import dispatch
    from tests.kernel_helpers import DEVICE
    from tests.triton_fp8 import exact_fp8_casts

    gen = torch.Generator().manual_seed(0)
    norm = OffsetRMSNorm(48, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(48, generator=gen))
    norm.to(DEVICE)
    norm.fp8_output, norm.dense_output = True, dense
    x, residual = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    x, residual = x.to(DEVICE), residual.to(DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    with torch.no_grad():
        want, want_residual = norm(x, residual)
        monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
        with exact_fp8_casts():
            got, got_residual = norm(x, residual)
    assert isinstance(got, QuantizedActivation) and isinstance(want, QuantizedActivation)
    apart = got.data.float() - want.data.float()
    step = want.data.float().abs().clamp(min=2.0**-6) * 2.0**-3  # an e4m3 step: 3 mantissa bits
    assert (apart.abs() <= step).all()
    torch.testing.assert_close(got.scale, want.scale, rtol=2e-6, atol=0)
    assert torch.equal(got_residual, want_residual)
    assert (got.dense is None) == (not dense)
    if dense:
        assert got.dense is not None and want.dense is not None
        torch.testing.assert_close(got.dense, want.dense, rtol=2e-6, atol=2e-6)
