"""MiniMax-M2 / M2.1 (MiniMaxM2ForCausalLM) end to end on the CPU, against transformers, on a tiny random
checkpoint saved with save_pretrained (2 layers, 8 experts top-2, 4 q heads over 2 kv heads of 16,
rotary_dim 8, a random correction bias that does move choices), its config.json given the published
configs' own keys (rotary_dim, qk_norm_type, scoring_func, num_mtp_modules, ...).

The q/k norms span all heads: the first half of q_proj's rows (heads 0-1, one TP rank's share of two)
and of k_proj's (kv head 0) are scaled by 3, so a norm over one rank's heads gives other tokens than
the whole one (checked: test_rank_local_qk_norm_changes_the_tokens), and TP=2 equal to TP=1 shows the
statistics are summed over the ranks.

Checked: greedy tokens identical to transformers' in fp32 through chunked prefills and prefix-cache
hits; multi-token-prediction layers skipped and unsupported configs refused by name; online FP8 and
the published block-scaled FP8 form (weight_scale_inv, fmt float8_e4m3fn, experts w1/w2/w3 in FP8,
router and bias float) near the dequantized model, router float32 and experts e4m3; TP=2 shards equal
to slices of the whole model, tokens equal to TP=1's; the Triton path against the PyTorch path; the
minimax-m2 preset's published size and its FP8 budget over two and four H200s.
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
from overnight.loader.model_loader import build_model, load_model
from overnight.loader.resolve import resolve_source
from overnight.models.glm4_moe import Glm4MoeMoE, Glm4MoeTopkRouter
from overnight.quant.apply import dequantize_model
from overnight.quant.linear import Fp8Linear
from tests.fp8_checkpoints import PROJECTIONS, make_fp8_checkpoint
from tests.parity_helpers import compare, greedy_tokens
from tests.test_glm4_moe import MAX_DLOGPROB, MIN_TOP1
from tests.tiny_moe import (
    ENGINE,
    check_waves_token_exact,
    load_moe_reference,
    make_moe_checkpoint,
    waves,
)
from tests.tp_helpers import generate_split, streamed_equals_sliced

PUBLISHED_KEYS = dict(
    rotary_dim=8, use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True,
    shared_intermediate_size=0, attn_type_list=[1, 1], use_mtp=True, num_mtp_modules=1,
    mtp_transformer_layers=1,
)  # fmt: skip


def make_minimax_checkpoint(folder: Path, seed: int = 0) -> Path:
    fields = dict(
        vocab_size=384, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, num_local_experts=8, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )  # fmt: skip

    def rank_0_heads_louder(model) -> None:
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight[:32] *= 3  # heads 0-1: rank 0's share under TP=2
            layer.self_attn.k_proj.weight[:16] *= 3  # kv head 0

    make_moe_checkpoint(folder, "MiniMaxM2", fields, seed, edit=rank_0_heads_louder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **PUBLISHED_KEYS}))
    return folder


def load_reference(folder: Path):
    return load_moe_reference(folder, "MiniMaxM2")


@pytest.fixture(scope="module")
def mm_folder(tmp_path_factory):
    return make_minimax_checkpoint(tmp_path_factory.mktemp("minimax") / "m2")


def test_engine_greedy_token_exact(mm_folder):
    """Token-exact with transformers in fp32, through 16-token prefill chunks and prefix-cache hits."""
    llm = LLM(str(mm_folder), **ENGINE)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    arch = model.arch
    assert all(
        isinstance(layer.mlp, Glm4MoeMoE) and layer.mlp.shared_experts is None for layer in model.model.layers
    )
    assert (arch.qk_norm, arch.qk_norm_whole, arch.rotary_dim, arch.router_scoring) == (
        True,
        True,
        8,
        "sigmoid",
    )
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (64,)  # all heads' channels
    ref = load_reference(mm_folder)
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()
    assert arch.num_parameters() == sum(p.numel() for p in ref.parameters()) + 2 * arch.num_experts  # + bias
    check_waves_token_exact(llm, ref, waves(arch.vocab_size))


class _HalvesNorm(nn.Module):
    """An RMSNorm over each half of its input on its own: what one TP=2 rank would compute from its own
    heads without the all-reduce of the sums of squares."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = []
        for part, weight in zip(x.chunk(2, -1), self.norm.weight.chunk(2)):
            var = part.float().pow(2).mean(-1, keepdim=True)
            out.append(weight * (part.float() * torch.rsqrt(var + self.norm.variance_epsilon)).to(x.dtype))
        return torch.cat(out, -1)


def test_rank_local_qk_norm_changes_the_tokens(mm_folder):
    """The TP=2 test's prompts tell a whole-vector q/k norm from one over a rank's heads only: with the
    latter the greedy tokens differ, so test_tp2_matches_tp1 fails if the statistics are not summed."""
    model = load_model(resolve_source(str(mm_folder)), torch.float32, "cpu")
    first, second = waves(384)
    prompts = first + second
    whole = greedy_tokens(model, prompts, 6)
    for layer in model.model.layers:
        layer.self_attn.q_norm = _HalvesNorm(layer.self_attn.q_norm)
        layer.self_attn.k_norm = _HalvesNorm(layer.self_attn.k_norm)
    local = greedy_tokens(model, prompts, 6)
    assert sum(a != b for a, b in zip(whole, local)) >= len(prompts) // 2, (whole, local)


def test_mtp_layers_are_skipped(tmp_path, mm_folder):
    """num_mtp_modules layers (model.layers.2.*, past num_hidden_layers) load as nothing."""
    folder = tmp_path / "mtp"
    shutil.copytree(mm_folder, folder)
    tensors = load_file(folder / "model.safetensors")
    mtp = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if ".layers.1." in k}
    save_file({**tensors, **mtp}, folder / "model.safetensors")
    a = dict(load_model(resolve_source(str(folder)), torch.float32, "cpu").named_parameters())
    b = dict(load_model(resolve_source(str(mm_folder)), torch.float32, "cpu").named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"attn_type_list": [0, 1]}, "lightning-attention layers"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        ({"qk_norm_type": "per_head"}, "qk_norm_type per_layer"),
        ({"shared_intermediate_size": 64}, "a shared expert"),
        ({"rotary_dim": 4}, "rotary_dim 4 disagrees with partial_rotary_factor 0.5"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok must be in 1..num_local_experts \(8\)"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path, mm_folder, change, message):
    folder = tmp_path / "cfg"
    shutil.copytree(mm_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ModelLoadError, match=message):
        resolve_source(str(folder))


def test_rotary_dim_alone_gives_the_partial_rotation(tmp_path, mm_folder):
    """The published configs say rotary_dim and no partial_rotary_factor."""
    folder = tmp_path / "cfg"
    shutil.copytree(mm_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = None
    cfg["rope_theta"] = 10000.0
    (folder / "config.json").write_text(json.dumps(cfg))
    assert resolve_source(str(folder)).arch.rotary_dim == 8


# -- FP8 -----------------------------------------------------------------------------------------------


def _assert_fp8_layout(model: nn.Module) -> None:
    moe = model.model.layers[1].mlp
    assert isinstance(moe.gate, Glm4MoeTopkRouter)
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert moe.experts.gate_up_proj.dtype == moe.experts.down_proj.dtype == torch.float8_e4m3fn
    layer = model.model.layers[1]  # the norm before qkv_proj hands over e4m3; the one before the router not
    assert layer.input_layernorm.fp8_output and not layer.post_attention_layernorm.fp8_output
    agree = compare(model, dequantize_model(copy.deepcopy(model)))
    assert agree.top1 >= MIN_TOP1 and agree.mean_dlogprob <= MAX_DLOGPROB, agree


def test_online_fp8_near_the_dequantized_model(mm_folder):
    _assert_fp8_layout(load_model(resolve_source(str(mm_folder), quantization="fp8"), torch.float32, "cpu"))


def test_published_block_fp8_checkpoint_loads_and_runs(mm_folder, tmp_path):
    """The published FP8 form: every projection (experts' w1 / w2 / w3 too) e4m3 with a
    weight_scale_inv grid, fmt float8_e4m3fn, router and correction bias float and not converted."""
    published = {
        "fmt": "float8_e4m3fn",
        "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
    }
    folder = make_fp8_checkpoint(
        mm_folder, tmp_path / "fp8", "fp8-block-small", (*PROJECTIONS, "w1", "w2", "w3"), published
    )
    stored = load_file(str(folder / "model.safetensors"))
    assert stored["model.layers.1.block_sparse_moe.experts.3.w2.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.1.block_sparse_moe.experts.3.w2.weight_scale_inv"].shape == (4, 1)
    assert stored["model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32
    model = load_model(resolve_source(str(folder)), torch.float32, "cpu")
    _assert_fp8_layout(model)
    llm = LLM(str(folder), **ENGINE)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = waves(384)[0]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy_tokens(model, prompts, 4)


# -- tensor parallelism ----------------------------------------------------------------------------------


def test_tp_shards_equal_slices_of_the_whole_model(mm_folder):
    """Each rank holds its heads' rows of the whole-vector q/k norms, its slice of every expert, and
    the float32 router whole."""
    source = resolve_source(str(mm_folder))
    whole = load_model(source, torch.float32, "cpu").model.layers[1]
    for rank in range(2):
        layer = streamed_equals_sliced(source, rank).model.layers[1]
        attn = layer.self_attn
        assert torch.equal(attn.q_norm.weight, whole.self_attn.q_norm.weight[32 * rank : 32 * (rank + 1)])
        assert torch.equal(attn.k_norm.weight, whole.self_attn.k_norm.weight[16 * rank : 16 * (rank + 1)])
        assert layer.mlp.gate.weight.shape == (8, 64) and layer.mlp.experts.gate_up_proj.shape == (8, 32, 64)


@pytest.mark.slow  # the fused MoE kernels through the Triton interpreter
def test_forward_with_kernels_matches_pytorch_path(mm_folder, monkeypatch):
    """The Triton path (grouped router kernel with one group, fused experts, partial RoPE after the
    whole-vector q/k norms) against the PyTorch path: a prefill of two requests and a decode step."""
    from overnight.kernels import dispatch
    from tests.kernel_helpers import DEVICE, run_steps

    model = load_model(resolve_source(str(mm_folder)), torch.float32, DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = run_steps(model)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    got = run_steps(model)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


@pytest.mark.slow  # starts tensor-parallel processes
def test_tp2_matches_tp1(mm_folder):
    first, second = waves(384)
    prompts = first + second
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    one = LLM(str(mm_folder), **ENGINE).generate(prompts, params, use_tqdm=False)
    two = generate_split(mm_folder, prompts, params, **ENGINE)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


# -- the preset ------------------------------------------------------------------------------------------


def test_minimax_m2_preset_has_published_size():
    source = resolve_source("minimax-m2", load_format="dummy")
    arch = source.arch
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (256, 8, 1536)
    assert (arch.rotary_dim, arch.qk_norm_whole, arch.num_hidden_layers) == (64, True, 62)
    model = build_model(source, torch.bfloat16, "meta")
    total = sum(p.numel() for p in model.parameters())
    assert total == arch.num_parameters()
    assert 228e9 < total < 231e9  # "230B total" on the model card (229B by the hub's count)
    active = total - arch.mlp_params() + arch.mlp_params(active_only=True)
    embeddings = 2 * arch.vocab_size * arch.hidden_size  # input table and (untied) LM head
    assert 9.5e9 < active - embeddings < 10.5e9  # "10B active"


def test_minimax_m2_fp8_budget_on_h200s():
    """MiniMax-M2 in FP8 over two H200s (`overnight budget`'s arithmetic for one rank): about 107 GiB of
    weights each and a KV pool for 3 sequences of 32K (4 kv heads a rank); over four, 35 of them; in
    bf16 two do not hold the weights."""
    from dataclasses import replace

    from overnight.options import EngineOptions
    from overnight.quant.scheme import QuantScheme
    from overnight.tools.budget import GIB, DeviceMemory, plan_budget

    h200 = DeviceMemory("NVIDIA H200", total_bytes=int(139.8 * GIB), free_bytes=int(139.3 * GIB))
    source = resolve_source("minimax-m2", load_format="dummy")
    fp8 = replace(source, quantization=QuantScheme())
    opts = EngineOptions(
        model="minimax-m2", load_format="dummy", dtype="bfloat16", max_model_len=32768, tensor_parallel_size=2
    )
    two = plan_budget(replace(opts, quantization="fp8"), fp8, h200)
    assert 106 * GIB < two.weights_bytes < 109 * GIB
    assert two.kv_bytes_per_token == 62 * 2 * 4 * 128 * 2 and two.seqs_fit >= 3
    four = plan_budget(replace(opts, quantization="fp8", tensor_parallel_size=4), fp8, h200)
    assert 53 * GIB < four.weights_bytes < 55 * GIB and four.seqs_fit >= 30
    assert plan_budget(opts, source, h200).num_blocks == 0  # bf16: 213 GiB of weights a rank
