"""AllenAI OLMoE (OlmoeForCausalLM) end to end on the CPU, against transformers, on a tiny random
checkpoint saved with save_pretrained: 2 layers, every one sparse with 8 experts top-2 and no
renormalization, RMSNorms over the whole q and k projections (k's over 2 KV heads of 4 q heads).

Checked: greedy tokens identical to transformers' in fp32 through 16-token prefill chunks and
prefix-cache hits; parameter counts equal to transformers'; unsupported configs refused by name;
online FP8 near the dequantized model and running through the engine; the Triton path against the
PyTorch path; the olmoe-1b-7b preset's published size.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.loader.model_loader import build_model, load_model
from overnight.loader.resolve import resolve_source
from overnight.models.qwen3_moe import Qwen3MoeSparseMoeBlock
from overnight.quant.apply import dequantize_model
from overnight.quant.linear import Fp8Linear
from tests.parity_helpers import compare, greedy_tokens
from tests.test_glm4_moe import MAX_DLOGPROB, MIN_TOP1
from tests.tiny_moe import ENGINE, check_waves_token_exact, load_moe_reference, make_moe_checkpoint, waves

FIELDS = dict(
    vocab_size=384, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)  # fmt: skip


@pytest.fixture(scope="module")
def olmoe_folder(tmp_path_factory):
    return make_moe_checkpoint(tmp_path_factory.mktemp("olmoe") / "tiny", "Olmoe", FIELDS)


def test_engine_greedy_token_exact(olmoe_folder):
    """Token-exact with transformers in fp32, through 16-token prefill chunks and prefix-cache hits."""
    llm = LLM(str(olmoe_folder), **ENGINE)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    arch = model.arch
    assert all(isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in model.model.layers)
    assert (arch.qk_norm, arch.qk_norm_whole, arch.norm_placement, arch.norm_topk_prob) == (
        True,
        True,
        "pre",
        False,
    )
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (32,)  # all heads' channels
    ref = load_moe_reference(olmoe_folder, "Olmoe")
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()
    assert arch.num_parameters() == sum(p.numel() for p in ref.parameters())
    check_waves_token_exact(llm, ref, waves(arch.vocab_size))


@pytest.mark.parametrize(
    "change,message",
    [
        ({"clip_qkv": 8.0}, "clip_qkv 8.0"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok must be in 1..num_experts \(8\)"),
        ({"head_dim": 32}, "head_dim other than"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path, olmoe_folder, change, message):
    folder = tmp_path / "cfg"
    shutil.copytree(olmoe_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ModelLoadError, match=message):
        resolve_source(str(folder))


def test_online_fp8_near_the_dequantized_model_and_runs(olmoe_folder):
    model = load_model(resolve_source(str(olmoe_folder), quantization="fp8"), torch.float32, "cpu")
    moe = model.model.layers[1].mlp
    assert moe.experts.gate_up_proj.dtype == torch.float8_e4m3fn and not isinstance(moe.gate, Fp8Linear)
    assert isinstance(model.model.layers[1].self_attn.qkv_proj, Fp8Linear)
    agree = compare(model, dequantize_model(copy.deepcopy(model)))
    assert agree.top1 >= MIN_TOP1 and agree.mean_dlogprob <= MAX_DLOGPROB, agree
    prompts = waves(384)[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = LLM(str(olmoe_folder), quantization="fp8", **ENGINE).generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == greedy_tokens(model, prompts, 4)


@pytest.mark.slow  # the fused MoE kernels through the Triton interpreter
def test_forward_with_kernels_matches_pytorch_path(olmoe_folder, monkeypatch):
    """The Triton path (router top-k kernel, fused experts, the whole-projection q/k norms) against
    the PyTorch path: a prefill of two requests and a decode step."""
    from overnight.kernels import dispatch
    from tests.kernel_helpers import DEVICE, run_steps

    model = load_model(resolve_source(str(olmoe_folder)), torch.float32, DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = run_steps(model)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    got = run_steps(model)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_olmoe_preset_has_published_size():
    source = resolve_source("olmoe-1b-7b", load_format="dummy")
    arch = source.arch
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (64, 8, 1024)
    model = build_model(source, torch.bfloat16, "meta")
    total = sum(p.numel() for p in model.parameters())
    assert total == arch.num_parameters()
    assert 6.8e9 < total < 7.0e9  # "6.9B total" on the model card
    active = total - arch.mlp_params() + arch.mlp_params(active_only=True)
    assert 1.2e9 < active < 1.4e9  # "1.3B active"
