"""Baidu ERNIE 4.5 end to end on the CPU, against transformers, on tiny random checkpoints saved with
save_pretrained: the MoE model (Ernie4_5_MoeForCausalLM: 4 layers, layer 0 dense by
moe_layer_start_index, layer 3 dense by moe_layer_end_index, 8 experts top-2, a shared expert, a random
correction bias that does move choices) and the dense 0.3B shape (Ernie4_5ForCausalLM), untied and tied.

Checked: greedy tokens identical to transformers' in fp32 through 16-token prefill chunks and
prefix-cache hits; parameter counts equal to transformers'; the router's choice against a plain
restatement of transformers' rule with the bias changing it; unsupported configs refused by name;
online FP8 (router and bias float32, experts e4m3) near the dequantized model; TP=2 shards (the
TP=2 engine run is tests/test_qwen2_moe.py's, on the same shared-expert rules); the
Triton path against the PyTorch path; the ernie-4.5-21b-a3b preset's published size.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.layers.moe import router_softmax_biased_topk
from overnight.loader.model_loader import build_model, load_model
from overnight.loader.resolve import resolve_source
from overnight.models.ernie4_5_moe import Ernie4_5_MoeSparseMoeBlock
from overnight.quant.apply import dequantize_model
from overnight.quant.linear import Fp8Linear
from tests.parity_helpers import compare, greedy_tokens, hf_greedy
from tests.test_glm4_moe import MAX_DLOGPROB, MIN_TOP1
from tests.tiny_moe import ENGINE, check_waves_token_exact, load_moe_reference, make_moe_checkpoint, waves
from tests.tp_helpers import streamed_equals_sliced

COMMON = dict(
    vocab_size=384, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, use_bias=False, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)  # fmt: skip
MOE = dict(
    COMMON, num_hidden_layers=4, moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
    moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=2, moe_layer_interval=1,
    tie_word_embeddings=False,
)  # fmt: skip


def _random_correction_bias(model) -> None:
    """transformers starts the bias at zeros, which would leave it out of every choice."""
    gen = torch.Generator().manual_seed(7)
    for name, param in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            param.copy_(0.05 * torch.randn(param.shape, generator=gen))


def make_ernie_moe_checkpoint(folder: Path, seed: int = 0) -> Path:
    return make_moe_checkpoint(folder, "Ernie4_5_Moe", MOE, seed, edit=_random_correction_bias)


@pytest.fixture(scope="module")
def ernie_folder(tmp_path_factory):
    return make_ernie_moe_checkpoint(tmp_path_factory.mktemp("ernie4_5_moe") / "tiny")


def test_engine_greedy_token_exact(ernie_folder):
    """Token-exact with transformers in fp32, through 16-token prefill chunks and prefix-cache hits."""
    llm = LLM(str(ernie_folder), **ENGINE)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    arch = model.arch
    kinds = [isinstance(layer.mlp, Ernie4_5_MoeSparseMoeBlock) for layer in model.model.layers]
    assert kinds == [False, True, True, False]
    assert (arch.rope_interleaved, arch.router_scoring) == (True, "softmax_bias")
    moe = model.model.layers[1].mlp
    assert moe.gate.weight.dtype == moe.moe_statics.e_score_correction_bias.dtype == torch.float32
    ref = load_moe_reference(ernie_folder, "Ernie4_5_Moe")
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()
    assert arch.num_parameters() == sum(p.numel() for p in ref.parameters())
    check_waves_token_exact(llm, ref, waves(arch.vocab_size))


def test_dense_ernie_greedy_token_exact(tmp_path):
    """Ernie4_5ForCausalLM (the 0.3B's shape: head_dim wider than hidden / heads), untied, through the
    two waves; then tied (as the published 0.3B and 21B are), whose random model repeats a token or
    two, so only equality with transformers is asked of it."""
    fields = dict(COMMON, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False)
    folder = make_moe_checkpoint(tmp_path / "dense", "Ernie4_5", fields)
    llm = LLM(str(folder), **ENGINE)
    ref = load_moe_reference(folder, "Ernie4_5")
    arch = llm.engine.runner.model.arch  # type: ignore[attr-defined]
    assert arch.num_parameters() == sum(p.numel() for p in ref.parameters())
    check_waves_token_exact(llm, ref, waves(arch.vocab_size))
    folder = make_moe_checkpoint(tmp_path / "tied", "Ernie4_5", dict(fields, tie_word_embeddings=True))
    llm = LLM(str(folder), **ENGINE)
    ref = load_moe_reference(folder, "Ernie4_5")
    assert llm.engine.runner.model.arch.tie_word_embeddings  # type: ignore[attr-defined]
    prompts = waves(384)[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(ref, p, 6)[0] for p in prompts]


def test_mtp_block_is_skipped(tmp_path, ernie_folder):
    """The 300B's multi-token-prediction tensors (model.mtp_block.N.*, mtp_emb_norm, ...) load as
    nothing; a stray tensor elsewhere is still refused."""
    folder = tmp_path / "mtp"
    shutil.copytree(ernie_folder, folder)
    tensors = load_file(folder / "model.safetensors")
    mtp = {
        "model.mtp_emb_norm.0.weight": torch.ones(64),
        "model.mtp_block.0.mlp.gate_proj.weight": torch.ones(96, 64),
    }
    save_file({**tensors, **mtp}, folder / "model.safetensors")
    a = dict(load_model(resolve_source(str(folder)), torch.float32, "cpu").named_parameters())
    b = dict(load_model(resolve_source(str(ernie_folder)), torch.float32, "cpu").named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    save_file({**tensors, "model.stray.weight": torch.ones(4)}, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.stray.weight"):
        load_model(resolve_source(str(folder)), torch.float32, "cpu")


def test_router_bias_chooses_and_the_probabilities_weigh():
    """transformers' rule restated: softmax, top-k of probabilities + bias, the chosen probabilities
    renormalized; a bias that lifts the least likely expert makes it chosen with its own small weight."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    weights, ids = router_softmax_biased_topk(logits, bias, 2)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[3, 0]]
    expected = probs[0, [3, 0]] / probs[0, [3, 0]].sum()
    torch.testing.assert_close(weights[0], expected)
    weights, ids = router_softmax_biased_topk(logits, torch.zeros(4), 2)
    assert ids.tolist() == [[0, 1]]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"use_bias": True}, "use_bias=true"),
        ({"moe_k": 9}, r"moe_k must be in 1..moe_num_experts \(8\)"),
        ({"moe_num_experts": [8, 8]}, "per-modality moe_num_experts"),
        ({"moe_gate": "top2"}, "moe_gate 'top2'"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path, ernie_folder, change, message):
    folder = tmp_path / "cfg"
    shutil.copytree(ernie_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ModelLoadError, match=message):
        resolve_source(str(folder))


def test_online_fp8_keeps_the_router_in_float32_and_runs(ernie_folder):
    source = resolve_source(str(ernie_folder), quantization="fp8")
    model = load_model(source, torch.float32, "cpu")
    moe = model.model.layers[1].mlp
    assert moe.gate.weight.dtype == moe.moe_statics.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.gate_up_proj.dtype == moe.experts.down_proj.dtype == torch.float8_e4m3fn
    assert isinstance(moe.shared_experts.gate_proj, Fp8Linear)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    agree = compare(model, dequantize_model(copy.deepcopy(model)))
    assert agree.top1 >= MIN_TOP1 and agree.mean_dlogprob <= MAX_DLOGPROB, agree
    prompts = waves(384)[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = LLM(str(ernie_folder), quantization="fp8", **ENGINE).generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == greedy_tokens(model, prompts, 4)


def test_tp_shards_equal_slices_of_the_whole_model(ernie_folder):
    """Routed and shared experts cut by their intermediate sizes; router and bias whole, float32."""
    source = resolve_source(str(ernie_folder))
    for rank in range(2):
        moe = streamed_equals_sliced(source, rank).model.layers[1].mlp
        assert moe.gate.weight.shape == (8, 64) and moe.moe_statics.e_score_correction_bias.shape == (1, 8)
        assert moe.experts.gate_up_proj.shape == (8, 32, 64)
        assert moe.shared_experts.gate_proj.weight.shape == (16, 64)


@pytest.mark.slow  # the fused MoE kernels through the Triton interpreter
def test_forward_with_kernels_matches_pytorch_path(ernie_folder, monkeypatch):
    from overnight.kernels import dispatch
    from tests.kernel_helpers import DEVICE, run_steps

    model = load_model(resolve_source(str(ernie_folder)), torch.float32, DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = run_steps(model)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    got = run_steps(model)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_ernie_45_21b_a3b_preset_has_published_size():
    source = resolve_source("ernie-4.5-21b-a3b", load_format="dummy")
    arch = source.arch
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (64, 6, 1536)
    assert arch.mlp_only_layers == (0,) and arch.shared_expert_intermediate_size == 2 * 1536
    model = build_model(source, torch.bfloat16, "meta")
    total = sum(p.numel() for p in model.parameters())
    assert total == arch.num_parameters()
    assert 21.5e9 < total < 22.0e9  # "21B total" on the model card (21.8B by the hub's count)
    active = total - arch.mlp_params() + arch.mlp_params(active_only=True)
    embeddings = arch.vocab_size * arch.hidden_size  # one table: tied
    assert 2.9e9 < active - embeddings < 3.2e9  # "3B activated"
