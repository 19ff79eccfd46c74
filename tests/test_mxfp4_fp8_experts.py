"""MXFP4 experts held as e4m3 (mxfp4_experts fp8, loader/expert_form.py and models/gpt_oss.py): chosen only
explicitly, refused where FP8 cannot run, counted by the memory checks as a byte a weight plus a float32
scale per row, and loaded from the tiny gpt-oss MXFP4 checkpoints of tests/test_gpt_oss.py.

The rows are requantized with power-of-two scales (quant/fp8.pow2_row_scales), which keep every e2m1
value exact unless its block's power of two is below 2^-15 of the row's largest magnitude. The tiny
checkpoints' rows are all within that range, so the e4m3 experts dequantize to the dense form's weights
bit for bit and the CPU path (which dequantizes the experts it runs) gives the dense form's logits
exactly. The generic per-row rule (scale amax / 448, the other MoE families') rounds about half the
weights of the same checkpoint, by up to 3.6% of a row's largest (e4m3's half step at 448):
test_generic_row_scales_would_round measures it. Through the engine that rule made 4 of the 6 greedy
sequences of test_engine_fp8_form_matches_dense leave the dense form's within 8 tokens, with
chosen-token logprobs off by up to 0.58 (mean 0.11) before they did (measured once, fp32 on the CPU). Rows past the subnormal floor lose their small blocks:
test_blocks_past_the_subnormal_floor bounds that error.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import ConfigError
from overnight.loader import fit
from overnight.loader.expert_form import check_expert_form_device, choose_expert_form
from overnight.loader.model_loader import build_model, load_model
from overnight.loader.resolve import PRESETS_DIR, resolve_source
from overnight.models.registry import arch_from_hf_config
from overnight.options import EngineOptions
from overnight.quant.fp8 import FP8_DTYPE, quantize_weight_per_channel
from overnight.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tests.test_gpt_oss import _config, _prompts
from tests.test_mxfp4_experts import mxfp4_pair  # noqa: F401 (a fixture)

GIB = 2**30
H100 = 80 * 10**9
H200 = 141 * 10**9
PROJECTIONS = (("gate_up_proj", "gate_up_scale"), ("down_proj", "down_scale"))


def _preset(name: str):
    cfg = json.loads((Path(PRESETS_DIR) / f"{name}.json").read_text())
    cfg["rope_scaling"] = None  # the byte count does not depend on RoPE
    return arch_from_hf_config(cfg)


def _form(source, choice: str):
    return replace(source, arch=choose_expert_form(source.arch, choice, 4, None).arch)


def _expert_counts(arch) -> tuple[int, int]:
    """(the experts' weights, their rows), all layers."""
    experts = sum(arch.is_moe_layer(i) for i in range(arch.num_hidden_layers)) * arch.num_experts
    return (
        experts * 3 * arch.hidden_size * arch.moe_intermediate_size,
        experts * (2 * arch.moe_intermediate_size + arch.hidden_size),
    )


# -- choosing the form ---------------------------------------------------------------------------------


def test_fp8_is_chosen_only_explicitly():
    arch = _preset("gpt-oss-120b")
    form = choose_expert_form(arch, "fp8", 2, H200)
    assert form.arch.experts_mxfp4_fp8 and form.arch.experts_mxfp4_dense
    assert not form.arch.holds_mxfp4_experts
    assert "e4m3" in form.reason
    for model in ("gpt-oss-20b", "gpt-oss-120b"):  # auto: dense or packed, never fp8 (yet)
        for device, tp in ((H100, 1), (H200, 1), (H100, 8), (None, 1)):
            assert not choose_expert_form(_preset(model), "auto", 2, device, tp).arch.experts_mxfp4_fp8
    with pytest.raises(ConfigError, match="experts are not MXFP4"):
        choose_expert_form(replace(arch, experts_mxfp4=False), "fp8", 2, H200)


def test_fp8_on_a_float_checkpoint_is_refused_before_loading(mxfp4_pair):  # noqa: F811
    from overnight.build import resolve_model

    float_twin = str(mxfp4_pair[1])  # the same model with float experts
    with pytest.raises(ConfigError, match="mxfp4_experts 'fp8' applies to MXFP4 checkpoints"):
        resolve_model(EngineOptions(model=float_twin, mxfp4_experts="fp8", device="cpu"))


def test_fp8_needs_an_fp8_gpu(monkeypatch):
    """A GPU below compute capability 8.9 is refused by name, before any weight is allocated on it (the
    build checks first; no CUDA call is made here past the patched queries)."""
    from overnight.loader.source import ModelSource

    cfg = {**_config().to_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    arch = arch_from_hf_config(cfg)
    fp8 = choose_expert_form(arch, "fp8", 2, H100).arch
    source = ModelSource("dummy", "x", fp8, "GptOssForCausalLM", None, (), None, None, "x")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"mxfp4_experts fp8 .* 8\.9 or newer .*; NVIDIA A100 is 8\.0"):
        check_expert_form_device(fp8, "cuda:0")
    with pytest.raises(ConfigError, match="--mxfp4-experts mxfp4 or dense"):
        build_model(source, torch.bfloat16, "cuda:0")
    check_expert_form_device(choose_expert_form(arch, "dense", 2, H100).arch, "cuda:0")  # no FP8 in it
    check_expert_form_device(fp8, "cpu")  # the reference path
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_expert_form_device(fp8, "cuda:0")


# -- the bytes the memory checks count -----------------------------------------------------------------


def test_20b_bytes_per_form():
    """A byte a weight plus a float32 scale per row (biases stay bf16): about 21 GiB for gpt-oss-20b,
    between the packed form's 12.8 and the dense form's 38.5."""
    arch = _preset("gpt-oss-20b")
    sizes = {
        choice: choose_expert_form(arch, choice, 2, H200).arch.weight_bytes(2)
        for choice in ("mxfp4", "dense", "fp8")
    }
    weights, rows = _expert_counts(arch)
    assert sizes["dense"] - sizes["fp8"] == weights - 4 * rows
    assert sizes["fp8"] - sizes["mxfp4"] == weights + 4 * rows - weights // 2 - weights // 32
    assert 12 < sizes["mxfp4"] / GIB < 14 and 20 < sizes["fp8"] / GIB < 22 and 38 < sizes["dense"] / GIB < 40
    # --quantization fp8 on top quantizes the projections; the experts are not counted twice
    fp8 = choose_expert_form(arch, "fp8", 2, H200).arch
    assert fp8.weight_bytes(2, fp8_linear=True, fp8_experts=True) == fp8.weight_bytes(2, fp8_linear=True)
    assert fp8.weight_bytes(2, fp8_linear=True) < sizes["fp8"]


def test_120b_fits_one_h200_in_fp8_and_not_dense(monkeypatch):
    """The weight-fit check with an H200's memory free (about 139 GiB): the fp8 form's ~110 GiB pass,
    the dense form's ~218 GiB do not."""
    arch = _preset("gpt-oss-120b")
    monkeypatch.setattr(fit, "available_memory_bytes", lambda device: 139 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu = torch.device("cuda", 0)
    fp8 = choose_expert_form(arch, "fp8", 2, H200).arch
    assert 105 < fit.weight_bytes(fp8, torch.bfloat16) / GIB < 115
    fit.check_weights_fit(fp8, torch.bfloat16, gpu, "gpt-oss-120b")
    dense = choose_expert_form(arch, "dense", 2, H200).arch
    with pytest.raises(ConfigError, match="gpt-oss-120b does not fit"):
        fit.check_weights_fit(dense, torch.bfloat16, gpu, "gpt-oss-120b")


def test_budget_counts_the_fp8_form():
    from overnight.build import resolve_model
    from overnight.tools.budget import DeviceMemory, plan_budget

    opts = EngineOptions(
        model="gpt-oss-20b", load_format="dummy", mxfp4_experts="fp8", device="cpu", dtype="bfloat16"
    )
    source = resolve_model(opts).source
    assert source.arch.experts_mxfp4_fp8
    weights = plan_budget(opts, source, DeviceMemory("H200", H200, H200)).weights_bytes
    assert weights == source.arch.weight_bytes(2)


# -- the loaded experts --------------------------------------------------------------------------------


def test_model_holds_what_weight_bytes_count(mxfp4_pair):  # noqa: F811
    model = load_model(_form(resolve_source(str(mxfp4_pair[0])), "fp8"), torch.bfloat16, "cpu")
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.gate_up_bias.dtype == torch.bfloat16
        held += 4 * (experts.gate_up_scale.numel() + experts.down_scale.numel())
    assert held == model.arch.weight_bytes(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_e4m3_experts_are_the_dense_weights_requantized_per_row(mxfp4_pair, dtype):  # noqa: F811
    """Every expert's e4m3 rows and scales equal the power-of-two per-row quantization of the dense form's
    weights (the reference), the scales are powers of two, and dequantized they are the dense weights
    exactly; biases and everything else are the dense form's."""
    packed, _ = mxfp4_pair
    source = resolve_source(str(packed))
    fp8 = load_model(_form(source, "fp8"), dtype, "cpu")
    dense = load_model(_form(source, "dense"), dtype, "cpu")
    dense_params = dict(dense.named_parameters())
    for name, p in fp8.named_parameters():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert torch.equal(p, dense_params[name]), name
    for a, b in zip(fp8.model.layers, dense.model.layers, strict=True):
        experts = a.mlp.experts
        for proj, scale_name in PROJECTIONS:
            data, scale, weight = (
                getattr(experts, proj),
                getattr(experts, scale_name),
                getattr(b.mlp.experts, proj),
            )
            assert data.dtype == FP8_DTYPE and scale.shape == data.shape[:2] and scale.dtype == torch.float32
            assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two
            for e in range(data.shape[0]):
                ref_data, ref_scale = quantize_weight_per_channel(weight[e], power_of_two=True)
                assert torch.equal(data[e].view(torch.uint8), ref_data.view(torch.uint8))
                assert torch.equal(scale[e], ref_scale)
            assert torch.equal((data.float() * scale[:, :, None]).to(dtype), weight)


def test_with_fp8_projections_too(mxfp4_pair):  # noqa: F811
    """--quantization fp8 beside the fp8 form: the projections become Fp8Linear and the experts, e4m3
    from the build on, are left as loaded (not quantized a second time)."""
    from overnight.quant.linear import Fp8Linear

    packed, _ = mxfp4_pair
    both = load_model(_form(resolve_source(str(packed), quantization="fp8"), "fp8"), torch.float32, "cpu")
    alone = load_model(_form(resolve_source(str(packed)), "fp8"), torch.float32, "cpu")
    assert isinstance(both.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    for a, b in zip(both.model.layers, alone.model.layers, strict=True):
        for proj, scale_name in PROJECTIONS:
            assert torch.equal(
                getattr(a.mlp.experts, proj).view(torch.uint8), getattr(b.mlp.experts, proj).view(torch.uint8)
            )
            assert torch.equal(getattr(a.mlp.experts, scale_name), getattr(b.mlp.experts, scale_name))


def test_generic_row_scales_would_round(mxfp4_pair):  # noqa: F811
    """The measurement behind the power-of-two scales: the same dense weights quantized with amax / 448
    per row come back exact for only about half of them, off by up to e4m3's half step at the row's top
    (16 / 448 = 3.6% of the row's largest magnitude)."""
    dense = load_model(_form(resolve_source(str(mxfp4_pair[0])), "dense"), torch.float32, "cpu")
    weight = dense.model.layers[0].mlp.experts.down_proj
    exact, worst = 0.0, 0.0
    for e in range(weight.shape[0]):
        data, scale = quantize_weight_per_channel(weight[e])
        back = data.float() * scale[:, None]
        exact += float((back == weight[e]).float().mean()) / weight.shape[0]
        worst = max(worst, float(((back - weight[e]).abs().amax(1) / weight[e].abs().amax(1)).max()))
    assert 0.3 < exact < 0.8 and 0.02 < worst <= 16 / 448 + 1e-6


def test_blocks_past_the_subnormal_floor():
    """A row whose blocks' powers of two span 2^0 .. 2^-19: the blocks at or above 2^-15 of the row's
    largest magnitude (6) come back exact, the rest are rounded to multiples of e4m3's least
    subnormal times the scale (2^-9 * 2^-6), so no weight is off by more than half of that."""
    k = 32 * 20
    gen = torch.Generator().manual_seed(0)
    values = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[torch.randint(0, 7, (k,), generator=gen)]
    values[0] = 6.0
    row = values * torch.exp2(-(torch.arange(k) // 32).float())  # block j: 2^-j
    blocks, scales = quantize_mxfp4(row[None])
    dense = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(dense[0], row)
    data, scale = quantize_weight_per_channel(dense, power_of_two=True)
    assert float(scale) == 2.0**-6  # 6 -> 384
    back = (data.float() * scale[:, None])[0]
    exact_blocks = [j for j in range(20) if 2.0**-j >= 6 * 2.0**-15]
    assert exact_blocks == list(range(13))
    assert torch.equal(back[: 32 * 13], row[: 32 * 13])
    assert not torch.equal(back, row)
    assert float((back - row).abs().max()) <= 0.5 * 2.0**-15


def test_each_rank_requantizes_its_share(mxfp4_pair):  # noqa: F811
    """Under tensor parallelism each rank dequantizes its slice of the packed rows (whole 32-column
    groups; rank 1's last one zero padding) and quantizes it per row: the dense form's rank share,
    requantized, bit for bit."""
    from overnight.parallel.tp_load import load_sharded_model

    source = resolve_source(str(mxfp4_pair[0]))
    for rank in range(2):
        fp8 = load_sharded_model(_form(source, "fp8"), torch.float32, "cpu", rank, 2)
        dense = load_sharded_model(_form(source, "dense"), torch.float32, "cpu", rank, 2)
        experts, reference = fp8.model.layers[0].mlp.experts, dense.model.layers[0].mlp.experts
        assert experts.pow2_scales and experts.gate_up_proj.shape[1] == 2 * 64
        for proj, scale_name in PROJECTIONS:
            data, scale = getattr(experts, proj), getattr(experts, scale_name)
            assert torch.equal(data.float() * scale[:, :, None], getattr(reference, proj))
        assert (not experts.down_proj[..., 32:].float().any()) == (rank == 1)  # the padded group


# -- outputs -------------------------------------------------------------------------------------------


def test_fused_fp8_experts_with_biases_and_clamped_swiglu():
    """The FP8 fused MoE (Triton; the interpreter on the CPU) takes gpt-oss's biases and clamped SwiGLU
    with e4m3 experts: against the layer's reference path on the same e4m3 weights, and that against the
    dense weights they hold exactly (power-of-two scales)."""
    from overnight.kernels.fused_moe import fused_experts
    from overnight.kernels.moe_configs import MoeConfig
    from overnight.kernels.moe_gemm import GemmTiles
    from overnight.layers.moe import ExpertActivation, fused_experts_ref, router_topk_ref
    from tests.kernel_helpers import DEVICE

    num_tokens, num_experts, top_k, hidden, inter = 11, 4, 2, 64, 32
    gen = torch.Generator().manual_seed(3)

    def mxfp4_dense(rows: int, k: int, scale: float) -> torch.Tensor:
        blocks, scales = quantize_mxfp4(scale * torch.randn(num_experts, rows, k, generator=gen))
        return dequantize_mxfp4(blocks, scales, torch.float32)

    w13, w2 = mxfp4_dense(2 * inter, hidden, 20 / hidden**0.5), mxfp4_dense(hidden, inter, 1 / inter**0.5)
    q13, s13 = zip(*(quantize_weight_per_channel(w, power_of_two=True) for w in w13), strict=True)
    q2, s2 = zip(*(quantize_weight_per_channel(w, power_of_two=True) for w in w2), strict=True)
    b13, b2 = (
        torch.randn(num_experts, 2 * inter, generator=gen),
        torch.randn(num_experts, hidden, generator=gen),
    )
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = router_topk_ref(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
    act = ExpertActivation("swiglu_oai", 1.702, 7.0)
    fp8 = [torch.stack(t).to(DEVICE) for t in (q13, s13, q2, s2)]
    config = MoeConfig(16, GemmTiles(16, 32, 1, 4, 2), GemmTiles(16, 32, 1, 4, 2))
    for dtype in (torch.float32, torch.float16):
        xs, bs = x.to(DEVICE, dtype), (b13.to(DEVICE, dtype), b2.to(DEVICE, dtype))
        kw = dict(gate_up_bias=bs[0], down_bias=bs[1])
        out = fused_experts(
            xs, fp8[0], fp8[2], weights.to(DEVICE), ids.to(DEVICE), config, fp8[1], fp8[3],
            activation=("swiglu_oai", 1.702, 7.0), **kw,
        )  # fmt: skip
        ref = fused_experts_ref(
            xs, fp8[0], fp8[2], weights.to(DEVICE), ids.to(DEVICE), fp8[1], fp8[3], activation=act, **kw
        )
        dense = fused_experts_ref(
            xs,
            w13.to(DEVICE, dtype),
            w2.to(DEVICE, dtype),
            weights.to(DEVICE),
            ids.to(DEVICE),
            activation=act,
            **kw,
        )
        assert torch.equal(ref, dense)  # the e4m3 experts hold the dense weights
        gate_up = torch.nn.functional.linear(xs.float(), w13[0].to(DEVICE)) + b13[0].to(DEVICE)
        assert float(gate_up.abs().max()) > 7.0  # the clamp acts
        tol = 1e-5 if dtype == torch.float32 else 4e-3
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * float(ref.abs().max()))


def test_forward_equals_the_dense_form(mxfp4_pair):  # noqa: F811
    """The CPU path dequantizes the e4m3 experts it runs, to the dense weights exactly: the logits match
    the dense form's to the bit (fp32), for a batch of two prompts through every layer."""
    from overnight.attention.metadata import AttentionBatch
    from overnight.attention.torch_backend import TorchAttentionBackend, build_metadata

    source = resolve_source(str(mxfp4_pair[0]))

    def logits(choice: str) -> torch.Tensor:
        model = load_model(_form(source, choice), torch.float32, "cpu")
        arch = model.arch
        caches = [
            torch.zeros(2, 8, 4, arch.num_key_value_heads, arch.head_dim)
            for _ in range(arch.num_hidden_layers)
        ]
        meta = build_metadata([9, 5], [9, 5], [[5, 2, 7], [1, 3]], 4, device="cpu")
        ids = torch.randint(3, arch.vocab_size, (14,), generator=torch.Generator().manual_seed(0))
        pos = torch.cat([torch.arange(9), torch.arange(5)])
        with torch.inference_mode():
            return model.compute_logits(
                model(ids, pos, AttentionBatch(meta, caches, TorchAttentionBackend()))
            )

    assert torch.equal(logits("fp8"), logits("dense"))


def test_engine_fp8_form_matches_dense(mxfp4_pair):  # noqa: F811
    """LLM(mxfp4_experts="fp8") on the CPU: greedy tokens and their logprobs are the dense form's."""
    packed, _ = mxfp4_pair
    prompts = [{"prompt_token_ids": p} for p in _prompts(256)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    options = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20)
    runs = {}
    for choice in ("dense", "fp8"):
        llm = LLM(str(packed), mxfp4_experts=choice, **options)
        assert llm.engine.config.model.arch.experts_mxfp4_fp8 == (choice == "fp8")
        runs[choice] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(runs["fp8"], runs["dense"], strict=True):
        assert list(a.token_ids) == list(b.token_ids)
        for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
            assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-5)
