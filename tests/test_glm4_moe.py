"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM) end to end on the CPU, against transformers, on tiny random
checkpoints saved with save_pretrained: 3 layers of which the first is dense, 8 experts (top-2) plus
shared experts, partial rotary 0.5, q/k/v biases, a random correction bias (so it does move choices),
in two variants:

    qk-norm   use_qk_norm, 2 groups of which 1 is chosen, routed_scaling_factor 2.5, 2 shared experts
    plain     no q/k norm, one group, weights not renormalized, no shared experts (transformers still
              writes a zero-width shared MLP, which loads as none)

Checked: greedy tokens identical to transformers' in fp32 through one engine run with chunked prefills
and prefix-cache hits; the kernel path (interpreted on the CPU) against the PyTorch path; online FP8 and
FP8 checkpoints near the float model, their experts e4m3 from the build on and quantized per row as
each tensor loads (the same bytes as quantizing the loaded stack; dummy weights and one TP rank's share
too); TP=2 shards equal to the whole model's slices and its tokens equal to TP=1's; multi-token-
prediction layers skipped; bad router configs refused; the glm-4.5-air preset's published size and its
FP8 budget on an H200. The router itself is checked against transformers' in
tests/test_kernels_grouped_router.py.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.layers.moe import Experts
from overnight.loader.model_loader import build_model, load_model
from overnight.loader.resolve import resolve_source
from overnight.models.glm4_moe import Glm4MoeMoE, Glm4MoeTopkRouter
from overnight.parallel.tp_load import load_sharded_model
from overnight.quant.apply import dequantize_model
from overnight.quant.fp8 import quantize_stacked_per_channel
from overnight.quant.linear import Fp8Linear
from tests.fp8_checkpoints import make_fp8_checkpoint
from tests.parity_helpers import compare
from tests.tiny_moe import (
    ENGINE,
    check_waves_token_exact,
    load_moe_reference,
    make_moe_checkpoint,
    waves,
)
from tests.tp_helpers import generate_split, streamed_equals_sliced

# n_shared_experts 0: transformers initializes (and loads) a zero-width shared MLP, and torch says so
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors:UserWarning")
VARIANTS = {
    "qk-norm": dict(use_qk_norm=True, n_group=2, topk_group=1, routed_scaling_factor=2.5, n_shared_experts=2),
    "plain": dict(use_qk_norm=False, n_shared_experts=0, norm_topk_prob=False),
}


def make_glm_checkpoint(folder: Path, seed: int = 0, **overrides) -> Path:
    fields = dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, attention_bias=True,
        partial_rotary_factor=0.5, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, norm_topk_prob=True,
    )  # fmt: skip
    return make_moe_checkpoint(folder, "Glm4Moe", {**fields, **overrides}, seed)


def load_reference(folder: Path):
    return load_moe_reference(folder, "Glm4Moe")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    folder = make_glm_checkpoint(tmp_path_factory.mktemp(request.param) / "glm", **VARIANTS[request.param])
    return request.param, folder


@pytest.fixture(scope="module")
def glm_folder(tmp_path_factory):
    return make_glm_checkpoint(tmp_path_factory.mktemp("glm") / "glm", **VARIANTS["qk-norm"])


def test_engine_greedy_token_exact(variant):
    """Token-exact with transformers in fp32, through 16-token prefill chunks and prefix-cache hits."""
    name, folder = variant
    llm = LLM(str(folder), **ENGINE)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    layers = model.model.layers
    assert [isinstance(layer.mlp, Glm4MoeMoE) for layer in layers] == [False, True, True]
    arch = model.arch
    assert (arch.qk_norm, arch.rotary_dim, arch.rope_interleaved) == (name == "qk-norm", 8, False)
    assert (layers[1].mlp.shared_experts is None) == (name == "plain")
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()
    ref = load_reference(folder)
    assert arch.num_parameters() == sum(p.numel() for p in ref.parameters()) + 2 * arch.num_experts
    check_waves_token_exact(llm, ref, waves(arch.vocab_size))


@pytest.mark.slow  # the fused MoE kernels through the Triton interpreter
def test_forward_with_kernels_matches_pytorch_path(glm_folder, monkeypatch):
    """The Triton path (grouped router kernel, fused experts, partial RoPE with q/k norms) against the
    PyTorch path on the same model: a prefill of two requests and a decode step of both."""
    from overnight.kernels import dispatch
    from tests.kernel_helpers import DEVICE, run_steps

    model = load_model(resolve_source(str(glm_folder)), torch.float32, DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = run_steps(model)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    got = run_steps(model)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_mtp_layers_are_skipped_and_other_strays_refused(tmp_path, glm_folder):
    """A checkpoint with a multi-token-prediction layer (model.layers.3.*, past num_hidden_layers) loads
    the same model; an unknown tensor elsewhere is still named."""
    folder = tmp_path / "mtp"
    shutil.copytree(glm_folder, folder)
    tensors = load_file(folder / "model.safetensors")
    mtp = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    mtp["model.layers.3.shared_head.norm.weight"] = torch.ones(64)
    save_file({**tensors, **mtp}, folder / "model.safetensors")
    a = dict(load_model(resolve_source(str(folder)), torch.float32, "cpu").named_parameters())
    b = dict(load_model(resolve_source(str(glm_folder)), torch.float32, "cpu").named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    save_file({**tensors, "model.layers.1.mlp.gate.stray": torch.zeros(8)}, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"unexpected tensors: model\.layers\.1\.mlp\.gate\.stray"):
        load_model(resolve_source(str(folder)), torch.float32, "cpu")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"n_group": 3}, "n_group 3 must split n_routed_experts 8"),
        ({"n_group": 2, "topk_group": 3}, r"topk_group must be in 1..n_group \(2\)"),
        ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, r"num_experts_per_tok must be in 1..2"),
        ({"n_routed_experts": None}, "lacks required field 'n_routed_experts'"),
        ({"routed_scaling_factor": 0}, "must be positive"),
    ],
)
def test_bad_router_configs_are_refused(tmp_path, glm_folder, change, message):
    folder = tmp_path / "cfg"
    shutil.copytree(glm_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        cfg.pop(key, None)
        if value is not None:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        resolve_source(str(folder))


# -- FP8 -----------------------------------------------------------------------------------------------

MIN_TOP1, MAX_DLOGPROB = 0.75, 0.45  # tests/test_fp8_moe.py says why MoE bounds are looser


def _assert_fp8_layout(model: nn.Module) -> None:
    moe = model.model.layers[1].mlp
    assert isinstance(moe.gate, Glm4MoeTopkRouter)
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert isinstance(moe.shared_experts.gate_proj, Fp8Linear)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, Fp8Linear)  # the dense first layer
    assert moe.experts.gate_up_proj.dtype == moe.experts.down_proj.dtype == torch.float8_e4m3fn
    layers = model.model.layers  # norms that feed an FP8 projection quantize their outputs
    assert layers[1].input_layernorm.fp8_output and layers[0].post_attention_layernorm.fp8_output
    assert not layers[1].post_attention_layernorm.fp8_output  # it feeds the router and the experts
    agree = compare(model, dequantize_model(copy.deepcopy(model)))
    assert agree.top1 >= MIN_TOP1 and agree.mean_dlogprob <= MAX_DLOGPROB, agree


def test_online_fp8_keeps_the_router_in_float32(glm_folder):
    """The experts are e4m3 from the build on (experts_fp8_at_load), each checkpoint tensor quantized
    per row as it loads: the same bytes and scales as quantizing the loaded float stack."""
    source = resolve_source(str(glm_folder), quantization="fp8")
    meta = build_model(source, torch.float32, "meta").model.layers[1].mlp.experts
    assert meta.gate_up_proj.dtype == torch.float8_e4m3fn and meta.compute_dtype == torch.float32
    model = load_model(source, torch.float32, "cpu")
    _assert_fp8_layout(model)
    float_experts = (
        load_model(resolve_source(str(glm_folder)), torch.float32, "cpu").model.layers[2].mlp.experts
    )
    experts = model.model.layers[2].mlp.experts
    # rank 1 of 2 loading the checkpoint: its rows of gate / up, its columns of down, quantized per row
    rank1 = load_sharded_model(source, torch.float32, "cpu", 1, 2).model.layers[2].mlp.experts
    mine = {"gate_up_proj": [*range(16, 32), *range(48, 64)], "down_proj": slice(16, 32)}
    for name in ("gate_up_proj", "down_proj"):
        dense = getattr(float_experts, name)
        data, scale = quantize_stacked_per_channel(dense)
        assert torch.equal(getattr(experts, name).view(torch.uint8), data.view(torch.uint8)), name
        assert torch.equal(getattr(experts, name.replace("_proj", "_scale")), scale), name
        share = dense[:, mine[name]] if name == "gate_up_proj" else dense[:, :, mine[name]]
        data, scale = quantize_stacked_per_channel(share)
        assert torch.equal(getattr(rank1, name).view(torch.uint8), data.view(torch.uint8)), name
        assert torch.equal(getattr(rank1, name.replace("_proj", "_scale")), scale), name


def test_fp8_dummy_weights_are_the_float_dummy_quantized():
    """Dummy FP8 experts (never a float stack of them) hold the float dummy model's draws quantized,
    unsharded and as one rank of two; the load-time budget counts them as e4m3."""
    from dataclasses import replace

    from overnight.loader.fit import weight_bytes
    from overnight.quant.scheme import QuantScheme

    preset = resolve_source("glm-4.5-air", load_format="dummy")
    arch = replace(
        preset.arch, num_hidden_layers=2, vocab_size=64, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    source = replace(preset, arch=arch)
    fp8 = replace(source, quantization=QuantScheme())
    whole = load_model(source, torch.float32, "cpu", seed=3).model.layers[1].mlp.experts
    ours = load_model(fp8, torch.float32, "cpu", seed=3).model.layers[1].mlp.experts
    rank1 = load_sharded_model(fp8, torch.float32, "cpu", 1, 2, seed=3).model.layers[1].mlp.experts
    assert rank1.compute_dtype == torch.float32 and rank1.gate_up_scale.shape == (8, 16)
    for name, rows in (("gate_up_proj", slice(None)), ("down_proj", slice(8, 16))):
        dense = getattr(whole, name)
        data, scale = quantize_stacked_per_channel(dense)
        assert torch.equal(getattr(ours, name).view(torch.uint8), data.view(torch.uint8)), name
        assert torch.equal(getattr(ours, name.replace("_proj", "_scale")), scale), name
        mine = dense[:, [*range(8, 16), *range(24, 32)]] if name == "gate_up_proj" else dense[:, :, rows]
        data, scale = quantize_stacked_per_channel(mine)
        assert torch.equal(getattr(rank1, name).view(torch.uint8), data.view(torch.uint8)), name
    loading = weight_bytes(preset.arch, torch.bfloat16, fp8_linear=True)
    assert loading == weight_bytes(preset.arch, torch.bfloat16, fp8_linear=True, loaded=True)
    assert loading < 120 * 2**30 < weight_bytes(preset.arch, torch.bfloat16)  # fits an H200's 141 GB


@pytest.mark.parametrize("layout", ["fp8-block-small", "ct-channel-dynamic"])
def test_fp8_checkpoint_loads_and_runs(glm_folder, tmp_path, layout):
    """Checkpoints in the FP8 formats published for MoE models (block-scaled as the fp8 method writes
    it, per-channel compressed-tensors; router and bias in float): experts dequantized at load and
    requantized per row, the engine's tokens the model's own."""
    from tests.parity_helpers import PROMPTS, greedy_tokens

    folder = make_fp8_checkpoint(glm_folder, tmp_path / "fp8", layout)
    stored = load_file(str(folder / "model.safetensors"))
    assert stored["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    model = load_model(resolve_source(str(folder)), torch.float32, "cpu")
    _assert_fp8_layout(model)
    llm = LLM(
        str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20
    )
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:6]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy_tokens(model, PROMPTS[:6], 4)


# -- tensor parallelism ----------------------------------------------------------------------------------


def test_tp_shards_equal_slices_of_the_whole_model(glm_folder):
    """Loading rank by rank gives each rank the weights apply_tp cuts from the whole model: routed
    experts and shared experts by their intermediate sizes, the float32 router replicated."""
    source = resolve_source(str(glm_folder))
    for rank in range(2):
        model = streamed_equals_sliced(source, rank)
        moe = model.model.layers[2].mlp
        assert moe.gate.weight.shape == (8, 64) and moe.gate.weight.dtype == torch.float32
        assert isinstance(moe.experts, Experts) and moe.experts.gate_up_proj.shape == (8, 32, 64)
        assert moe.shared_experts.gate_proj.weight.shape == (32, 64)  # 2 shared experts of 32, halved
        assert moe.shared_experts.down_proj.weight.shape == (64, 32)


@pytest.mark.slow  # starts tensor-parallel processes
def test_tp2_matches_tp1(glm_folder):
    first, second = waves(384)
    prompts = first + second
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    one = LLM(str(glm_folder), **ENGINE).generate(prompts, params, use_tqdm=False)
    two = generate_split(glm_folder, prompts, params, **ENGINE)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


# -- the preset ------------------------------------------------------------------------------------------


def test_glm_45_air_preset_has_published_shapes():
    source = resolve_source("glm-4.5-air", load_format="dummy")
    arch = source.arch
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (128, 8, 1408)
    assert arch.mlp_only_layers == (0,) and arch.shared_expert_intermediate_size == 1408
    assert (arch.rotary_dim, arch.attention_bias, arch.o_proj_bias, arch.qk_norm) == (64, True, False, False)
    model = build_model(source, torch.bfloat16, "meta")
    total = sum(p.numel() for p in model.parameters())
    assert total == arch.num_parameters()
    assert 106e9 < total < 108e9  # "106B" on the model card, which counts without the MTP layer
    active = total - arch.mlp_params() + arch.mlp_params(active_only=True)
    embeddings = 2 * arch.vocab_size * arch.hidden_size  # input table and (untied) LM head
    assert 12e9 < active - embeddings < 12.5e9  # "12B active", counted without them


def test_glm_45_air_fp8_budget_on_an_h200():
    """GLM-4.5-Air in FP8 on one H200 (`overnight budget`'s arithmetic): about 101 GiB of weights (the
    float32 routers counted as such) and a KV pool for 3 sequences of 32K; in bf16 the weights alone
    do not fit."""
    from dataclasses import replace

    from overnight.options import EngineOptions
    from overnight.quant.scheme import QuantScheme
    from overnight.tools.budget import GIB, DeviceMemory, plan_budget

    h200 = DeviceMemory("NVIDIA H200", total_bytes=int(139.8 * GIB), free_bytes=int(139.3 * GIB))
    source = resolve_source("glm-4.5-air", load_format="dummy")
    opts = EngineOptions(model="glm-4.5-air", load_format="dummy", dtype="bfloat16", max_model_len=32768)
    fp8 = plan_budget(replace(opts, quantization="fp8"), replace(source, quantization=QuantScheme()), h200)
    assert 100 * GIB < fp8.weights_bytes < 102 * GIB
    # 21 GiB of KV pool at 184 KiB a token: 3 sequences of 32K, 120K tokens in all
    assert fp8.kv_bytes_per_token == 46 * 2 * 8 * 128 * 2 and fp8.seqs_fit >= 3
    assert fp8.num_blocks * fp8.block_size >= 110_000
    assert plan_budget(opts, source, h200).num_blocks == 0  # bf16: 199 GiB of weights
