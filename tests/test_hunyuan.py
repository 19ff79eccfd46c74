"""Tencent Hunyuan end to end on the CPU, against transformers, on tiny random checkpoints saved with
save_pretrained: the MoE model (HunYuanMoEV1ForCausalLM: 2 layers, 8 experts top-2, the shared MLP,
per-head q/k norms after RoPE, dynamic RoPE with alpha 1000) and the dense one
(HunYuanDenseV1ForCausalLM).

Checked: greedy tokens identical to transformers' in fp32 through 16-token prefill chunks and
prefix-cache hits; parameter counts equal to transformers'; the q/k norms' place (before RoPE gives
other tokens); unsupported configs refused by name; online FP8 near the dequantized model and running;
TP=2 shards; the Triton path against the PyTorch path; the hunyuan-a13b preset's published size and
FP8 budget.
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
from overnight.models.hunyuan import HunYuanMoEV1Moe
from overnight.quant.apply import dequantize_model
from overnight.quant.linear import Fp8Linear
from tests.parity_helpers import compare, greedy_tokens
from tests.test_glm4_moe import MAX_DLOGPROB, MIN_TOP1
from tests.tiny_moe import ENGINE, check_waves_token_exact, load_moe_reference, make_moe_checkpoint, waves
from tests.tp_helpers import streamed_equals_sliced

COMMON = dict(
    vocab_size=384, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
    eos_token_id=2, pad_token_id=0,
    rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0},
)  # fmt: skip
MOE = dict(COMMON, num_experts=8, moe_topk=2)


def _uneven_qk_norms(model) -> None:
    """Norm weights that differ along the head: only then does their place around RoPE (a rotation,
    which keeps a head's RMS) change anything."""
    gen = torch.Generator().manual_seed(3)
    for name, param in model.named_parameters():
        if name.endswith(("query_layernorm.weight", "key_layernorm.weight")):
            param.copy_(1 + 0.5 * torch.randn(param.shape, generator=gen))


@pytest.fixture(scope="module")
def hy_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hunyuan") / "moe"
    return make_moe_checkpoint(folder, "HunYuanMoEV1", MOE, edit=_uneven_qk_norms)


def test_engine_greedy_token_exact(hy_folder):
    """Token-exact with transformers in fp32, through 16-token prefill chunks and prefix-cache hits."""
    llm = LLM(str(hy_folder), **ENGINE)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    arch = model.arch
    assert all(isinstance(layer.mlp, HunYuanMoEV1Moe) for layer in model.model.layers)
    assert (arch.qk_norm, arch.qk_norm_after_rope, arch.rope_scaling) == (True, True, None)
    assert arch.rope_theta == pytest.approx(10000.0 * 1000.0 ** (16 / 14))
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32
    ref = load_moe_reference(hy_folder, "HunYuanMoEV1")
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()
    assert arch.num_parameters() == sum(p.numel() for p in ref.parameters())
    check_waves_token_exact(llm, ref, waves(arch.vocab_size))


def test_dense_hunyuan_greedy_token_exact(tmp_path):
    fields = dict(COMMON, intermediate_size=96)
    folder = make_moe_checkpoint(tmp_path / "dense", "HunYuanDenseV1", fields, edit=_uneven_qk_norms)
    llm = LLM(str(folder), **ENGINE)
    ref = load_moe_reference(folder, "HunYuanDenseV1")
    arch = llm.engine.runner.model.arch  # type: ignore[attr-defined]
    assert arch.num_experts == 0 and arch.num_parameters() == sum(p.numel() for p in ref.parameters())
    check_waves_token_exact(llm, ref, waves(arch.vocab_size))


def test_norms_before_rope_give_other_tokens(hy_folder):
    """The waves tell the norms' place: with them before RoPE (Qwen3's order) the tokens differ."""
    model = load_model(resolve_source(str(hy_folder)), torch.float32, "cpu")
    first, second = waves(384)
    prompts = first + second
    after = greedy_tokens(model, prompts, 6)
    for layer in model.model.layers:
        layer.self_attn.qk_norm_after_rope = False
    before = greedy_tokens(model, prompts, 6)
    assert sum(a != b for a, b in zip(after, before)) >= len(prompts) // 2, (after, before)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"use_cla": True}, "use_cla=true"),
        ({"moe_topk": [2, 1]}, "moe_topk differing between layers"),
        ({"num_shared_expert": [2, 2]}, "a shared MLP count other than one"),
        ({"moe_intermediate_size": 64}, "moe_intermediate_size other than intermediate_size"),
        ({"rope_parameters": {**COMMON["rope_parameters"], "factor": 2.0}}, "factor 2.0"),  # type: ignore[dict-item]
    ],
)
def test_unsupported_configs_are_refused(tmp_path, hy_folder, change, message):
    folder = tmp_path / "cfg"
    shutil.copytree(hy_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ModelLoadError, match=message):
        resolve_source(str(folder))


def test_online_fp8_near_the_dequantized_model_and_runs(hy_folder):
    model = load_model(resolve_source(str(hy_folder), quantization="fp8"), torch.float32, "cpu")
    moe = model.model.layers[1].mlp
    assert moe.gate.weight.dtype == torch.float32 and moe.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert isinstance(moe.shared_mlp.gate_proj, Fp8Linear)
    agree = compare(model, dequantize_model(copy.deepcopy(model)))
    assert agree.top1 >= MIN_TOP1 and agree.mean_dlogprob <= MAX_DLOGPROB, agree
    prompts = waves(384)[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = LLM(str(hy_folder), quantization="fp8", **ENGINE).generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == greedy_tokens(model, prompts, 4)


def test_tp_shards_equal_slices_of_the_whole_model(hy_folder):
    """Routed experts and the shared MLP cut by their intermediate size; the router whole, float32."""
    source = resolve_source(str(hy_folder))
    for rank in range(2):
        moe = streamed_equals_sliced(source, rank).model.layers[1].mlp
        assert moe.gate.weight.shape == (8, 64) and moe.experts.gate_up_proj.shape == (8, 32, 64)
        assert moe.shared_mlp.gate_proj.weight.shape == (16, 64)
        assert moe.shared_mlp.down_proj.weight.shape == (64, 16)


@pytest.mark.slow  # the fused MoE kernels through the Triton interpreter
def test_forward_with_kernels_matches_pytorch_path(hy_folder, monkeypatch):
    """The Triton path (rotation kernel without the norms, then the RMSNorm kernel on each head; router
    top-k, fused experts) against the PyTorch path: a prefill of two requests and a decode step."""
    from overnight.kernels import dispatch
    from tests.kernel_helpers import DEVICE, run_steps

    model = load_model(resolve_source(str(hy_folder)), torch.float32, DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = run_steps(model)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    got = run_steps(model)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_hunyuan_a13b_preset_has_published_size():
    source = resolve_source("hunyuan-a13b", load_format="dummy")
    arch = source.arch
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (64, 8, 3072)
    assert arch.qk_norm_after_rope and arch.rope_scaling is None
    model = build_model(source, torch.bfloat16, "meta")
    total = sum(p.numel() for p in model.parameters())
    assert total == arch.num_parameters()
    assert 79.5e9 < total < 80.5e9  # "80B total" on the model card
    active = total - arch.mlp_params() + arch.mlp_params(active_only=True)
    assert 12.5e9 < active < 14e9  # "13B active"


def test_hunyuan_a13b_fp8_budget_on_an_h200():
    """`overnight budget`'s arithmetic: in FP8 the 80B weights take about 75 GiB and one H200 holds 10+
    sequences of 32K beside them (8 KV heads of 128, 32 layers); in bf16 (150 GiB) nothing fits."""
    from dataclasses import replace

    from overnight.options import EngineOptions
    from overnight.quant.scheme import QuantScheme
    from overnight.tools.budget import GIB, DeviceMemory, plan_budget

    h200 = DeviceMemory("NVIDIA H200", total_bytes=int(139.8 * GIB), free_bytes=int(139.3 * GIB))
    source = resolve_source("hunyuan-a13b", load_format="dummy")
    opts = EngineOptions(model="hunyuan-a13b", load_format="dummy", dtype="bfloat16", max_model_len=32768)
    fp8 = plan_budget(replace(opts, quantization="fp8"), replace(source, quantization=QuantScheme()), h200)
    assert 74 * GIB < fp8.weights_bytes < 77 * GIB
    assert fp8.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2 and fp8.seqs_fit >= 10
    assert plan_budget(opts, source, h200).num_blocks == 0
