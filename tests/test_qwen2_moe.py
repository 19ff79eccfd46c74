"""Qwen1.5-MoE / Qwen2-MoE (Qwen2MoeForCausalLM) end to end on the CPU, against transformers, on a tiny
random checkpoint saved with save_pretrained: 3 layers, the middle one dense (mlp_only_layers), 8
experts top-2 without renormalization (norm_topk_prob false, the published setting), a shared expert
behind its sigmoid gate, q/k/v biases.

Checked: greedy tokens identical to transformers' in fp32 through 16-token prefill chunks and
prefix-cache hits; parameter counts equal to transformers'; decoder_sparse_step's layer kinds;
unsupported configs refused by name; online FP8 (router and shared-expert gate kept in the compute
dtype, experts e4m3) near the dequantized model and running through the engine; TP=2 shards; the
Triton path against the PyTorch path; the qwen1.5-moe-a2.7b preset's published size.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.loader.model_loader import build_model, load_model
from overnight.loader.resolve import resolve_source
from overnight.models.qwen3_next import SharedExpertMoe
from overnight.quant.apply import dequantize_model
from overnight.quant.linear import Fp8Linear
from tests.parity_helpers import compare, greedy_tokens
from tests.test_glm4_moe import MAX_DLOGPROB, MIN_TOP1
from tests.tiny_moe import ENGINE, check_waves_token_exact, load_moe_reference, make_moe_checkpoint, waves
from tests.tp_helpers import generate_split, streamed_equals_sliced

FIELDS = dict(
    vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1], qkv_bias=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)  # fmt: skip


def make_qwen2_moe_checkpoint(folder: Path, seed: int = 0, **overrides: object) -> Path:
    return make_moe_checkpoint(folder, "Qwen2Moe", {**FIELDS, **overrides}, seed)


@pytest.fixture(scope="module")
def q2_folder(tmp_path_factory):
    return make_qwen2_moe_checkpoint(tmp_path_factory.mktemp("qwen2_moe") / "tiny")


def test_engine_greedy_token_exact(q2_folder):
    """Token-exact with transformers in fp32, through 16-token prefill chunks and prefix-cache hits."""
    llm = LLM(str(q2_folder), **ENGINE)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    arch = model.arch
    assert [isinstance(layer.mlp, SharedExpertMoe) for layer in model.model.layers] == [True, False, True]
    assert (arch.attention_bias, arch.o_proj_bias, arch.qk_norm, arch.norm_topk_prob) == (
        True,
        False,
        False,
        False,
    )
    ref = load_moe_reference(q2_folder, "Qwen2Moe")
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()
    assert arch.num_parameters() == sum(p.numel() for p in ref.parameters())
    check_waves_token_exact(llm, ref, waves(arch.vocab_size))


def test_sparse_step_and_dense_layers_follow_the_config(tmp_path, q2_folder):
    """decoder_sparse_step 2: layers 1 and 3 sparse (transformers' rule), minus mlp_only_layers."""
    folder = tmp_path / "cfg"
    shutil.copytree(q2_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    (folder / "config.json").write_text(json.dumps(cfg))
    arch = resolve_source(str(folder)).arch
    assert [arch.is_moe_layer(i) for i in range(4)] == [False, True, False, False]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"shared_expert_intermediate_size": 0}, "positive shared_expert_intermediate_size"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok must be in 1..num_experts \(8\)"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path, q2_folder, change, message):
    folder = tmp_path / "cfg"
    shutil.copytree(q2_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ModelLoadError, match=message):
        resolve_source(str(folder))


def test_online_fp8_keeps_router_and_shared_gate_and_runs(q2_folder):
    """quantization="fp8": attention, dense MLP and shared expert in FP8, the routed experts e4m3 with
    row scales, the router and the one-row shared-expert gate in the compute dtype; near the
    dequantized model, and the engine's greedy tokens are the loaded model's."""
    source = resolve_source(str(q2_folder), quantization="fp8")
    model = load_model(source, torch.float32, "cpu")
    moe = model.model.layers[0].mlp
    assert isinstance(moe, SharedExpertMoe)
    assert moe.experts.gate_up_proj.dtype == moe.experts.down_proj.dtype == torch.float8_e4m3fn
    assert not isinstance(moe.gate, Fp8Linear) and not isinstance(moe.shared_expert_gate, Fp8Linear)
    assert isinstance(moe.shared_expert.gate_proj, Fp8Linear)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    agree = compare(model, dequantize_model(copy.deepcopy(model)))
    assert agree.top1 >= MIN_TOP1 and agree.mean_dlogprob <= MAX_DLOGPROB, agree
    prompts = waves(384)[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = LLM(str(q2_folder), quantization="fp8", **ENGINE).generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == greedy_tokens(model, prompts, 4)


def test_tp_shards_equal_slices_of_the_whole_model(q2_folder):
    """Rank by rank: routed experts and the shared expert cut by their intermediate sizes, the router
    and the shared-expert gate whole."""
    source = resolve_source(str(q2_folder))
    for rank in range(2):
        moe = streamed_equals_sliced(source, rank).model.layers[2].mlp
        assert moe.gate.weight.shape == (8, 64) and moe.shared_expert_gate.weight.shape == (1, 64)
        assert moe.experts.gate_up_proj.shape == (8, 32, 64)
        assert moe.shared_expert.gate_proj.weight.shape == (24, 64)
        assert moe.shared_expert.down_proj.weight.shape == (64, 24)


@pytest.mark.slow  # starts tensor-parallel processes
def test_tp2_matches_tp1(q2_folder):
    first, second = waves(384)
    prompts = first + second
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    one = LLM(str(q2_folder), **ENGINE).generate(prompts, params, use_tqdm=False)
    two = generate_split(q2_folder, prompts, params, **ENGINE)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


@pytest.mark.slow  # the fused MoE kernels through the Triton interpreter
def test_forward_with_kernels_matches_pytorch_path(q2_folder, monkeypatch):
    """The Triton path (router top-k kernel, fused experts, the shared expert beside them) against the
    PyTorch path: a prefill of two requests and a decode step."""
    from overnight.kernels import dispatch
    from tests.kernel_helpers import DEVICE, run_steps

    model = load_model(resolve_source(str(q2_folder)), torch.float32, DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = run_steps(model)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    got = run_steps(model)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_qwen15_moe_preset_has_published_size():
    source = resolve_source("qwen1.5-moe-a2.7b", load_format="dummy")
    arch = source.arch
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (60, 4, 1408)
    assert (arch.shared_expert_intermediate_size, arch.attention_bias, arch.norm_topk_prob) == (
        5632,
        True,
        False,
    )
    model = build_model(source, torch.bfloat16, "meta")
    total = sum(p.numel() for p in model.parameters())
    assert total == arch.num_parameters()
    assert 14.2e9 < total < 14.4e9  # "14.3B parameters in total" on the model card
    active = total - arch.mlp_params() + arch.mlp_params(active_only=True)
    assert 2.6e9 < active < 2.8e9  # "2.7B activated"
