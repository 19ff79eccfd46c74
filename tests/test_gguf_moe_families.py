"""GGUF files of gpt-oss and Qwen1.5-MoE / Qwen2-MoE (loader/gguf_families.py), written here from tiny
random transformers models the way llama.cpp's converter writes them: tensor names from gguf-py's own
tensor map, gpt-oss's gate/up de-interleaved (or fused, gate rows then up rows) and its experts in
ggml's MXFP4, Qwen2-MoE's stacked experts, some tensors in Q8_0. The quantized tensors of the reference
model are replaced by their round trip through the same quantizer first, so the engine on the GGUF file
must give transformers' greedy tokens exactly (fp32), and the arch read back must equal the one read
from the HF folder."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from overnight import LLM
from overnight.errors import ModelLoadError
from overnight.loader.gguf import iter_gguf_weights, read_gguf
from overnight.loader.resolve import resolve_source
from tests.test_gpt_oss import _config, _engine_tokens, _hf_greedy, _prompts, _spread
from tests.test_qwen2_moe import FIELDS as QWEN2_MOE_FIELDS
from tests.tiny_models import _spread_weights
from tests.tiny_moe import ENGINE, check_waves_token_exact, waves

pytestmark = pytest.mark.slow  # engines beside transformers


def _round_trip(a: np.ndarray, qtype: Q) -> np.ndarray:
    """`a` through ggml's quantizer and back (blocks along the last axis, as the file stores them);
    quantizing the result again gives the same bytes, so the file holds exactly these values."""
    out = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
    again = gguf.quants.dequantize(gguf.quants.quantize(out, qtype), qtype)
    assert np.array_equal(again, out)
    return out


@torch.no_grad()
def _quantize_in_place(param: torch.Tensor, qtype: Q, transposed: bool) -> None:
    """The reference's parameter as the file will hold it; `transposed`: the file stores its last two
    axes swapped (gpt-oss's [E, in, out] experts)."""
    a = param.numpy()
    a = (
        _round_trip(a.swapaxes(-1, -2).copy(), qtype).swapaxes(-1, -2)
        if transposed
        else _round_trip(a, qtype)
    )
    param.copy_(torch.from_numpy(np.ascontiguousarray(a)))


def _writer(path: Path, arch: str, cfg) -> gguf.GGUFWriter:
    """The metadata the converter's base class writes for any decoder."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if getattr(cfg, "rms_norm_eps", None) is not None:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts or getattr(cfg, "n_routed_experts", None):
        w.add_expert_count(experts or cfg.n_routed_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_eos_token_id(2)
    w.add_bos_token_id(1)
    return w


def _finish(w: gguf.GGUFWriter, tensors: dict[str, np.ndarray], quant: dict[str, Q]) -> None:
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        if name in quant:
            w.add_tensor(name, gguf.quants.quantize(a, quant[name]), raw_dtype=quant[name])
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _mapped(sd: dict[str, torch.Tensor], arch: gguf.MODEL_ARCH, layers: int, special: Callable) -> dict:
    """GGUF name -> array: `special(name, array)` first (the family's reshapes; None: not handled),
    then gguf-py's tensor map for the rest."""
    names = gguf.get_tensor_name_map(arch, layers)
    out: dict[str, np.ndarray] = {}
    for name, t in sd.items():
        a = t.numpy().astype(np.float32)
        handled = special(name, a)
        if handled is not None:
            out.update(handled)
            continue
        # the converter's renames: gpt-oss's sinks gain .weight, the router's correction bias becomes .bias
        key = name.replace("e_score_correction_bias", "e_score_correction.bias")
        key = key if key.endswith((".weight", ".bias")) else key + ".weight"
        new = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        out[new] = a
    return out


# ---------------------------------------------------------------------------------------------- gpt-oss


def write_gpt_oss_gguf(path: Path, model, fused: bool, drop: str = "") -> None:
    """As convert_hf_to_gguf.py's GptOssModel: gate/up de-interleaved ([E, in, out] -> [E, out, in]),
    split into ffn_gate_exps / ffn_up_exps or fused gate-then-up, biases likewise; experts in MXFP4."""
    cfg = model.config
    rope = cfg.rope_parameters
    w = _writer(path, "gpt-oss", cfg)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])

    def special(name: str, a: np.ndarray) -> dict[str, np.ndarray] | None:
        if ".mlp.experts." not in name:
            return None
        blk = f"blk.{name.split('.')[2]}"
        leaf = name.rpartition(".")[2]
        if leaf == "down_proj":
            return {f"{blk}.ffn_down_exps.weight": a.swapaxes(1, 2)}
        if leaf == "down_proj_bias":
            return {f"{blk}.ffn_down_exps.bias": a}
        if leaf == "gate_up_proj":
            a = a.swapaxes(1, 2)
            gate, up = a[:, 0::2], a[:, 1::2]
            if fused:
                return {f"{blk}.ffn_gate_up_exps.weight": np.concatenate([gate, up], axis=1)}
            return {f"{blk}.ffn_gate_exps.weight": gate, f"{blk}.ffn_up_exps.weight": up}
        assert leaf == "gate_up_proj_bias", name
        gate, up = a[:, 0::2], a[:, 1::2]
        if fused:
            return {f"{blk}.ffn_gate_up_exps.bias": np.concatenate([gate, up], axis=1)}
        return {f"{blk}.ffn_gate_exps.bias": gate, f"{blk}.ffn_up_exps.bias": up}

    tensors = _mapped(model.state_dict(), gguf.MODEL_ARCH.GPT_OSS, cfg.num_hidden_layers, special)
    tensors.pop(drop, None)
    quant = {n: Q.MXFP4 for n in tensors if "_exps.weight" in n}
    quant["blk.1.attn_q.weight"] = Q.Q8_0
    _finish(w, tensors, quant)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(the reference model with the file's quantized values, its HF folder, the two GGUF files)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(_config()).eval()
    _spread(model, 0)
    for layer in model.model.layers:
        _quantize_in_place(layer.mlp.experts.gate_up_proj, Q.MXFP4, transposed=True)
        _quantize_in_place(layer.mlp.experts.down_proj, Q.MXFP4, transposed=True)
    _quantize_in_place(model.model.layers[1].self_attn.q_proj.weight, Q.Q8_0, transposed=False)
    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    model.save_pretrained(root / "hf")
    files = {}
    for fused in (False, True):
        files[fused] = root / f"gpt-oss-{'fused' if fused else 'split'}.gguf"
        write_gpt_oss_gguf(files[fused], model, fused)
    return model, root / "hf", files


@pytest.mark.parametrize("fused", [False, True])
def test_gpt_oss_gguf_token_exact(gpt_oss, fused):
    model, folder, files = gpt_oss
    info = read_gguf(str(files[fused]))
    assert info.hf_architecture == "GptOssForCausalLM"
    assert info.arch == resolve_source(str(folder)).arch
    assert info.arch.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert dict(info.arch.rope_scaling or ())["truncate"] is False
    prompts = _prompts(model.config.vocab_size)
    expected = [_hf_greedy(model, p) for p in prompts]
    assert len({tuple(e) for e in expected}) > 1
    assert _engine_tokens(files[fused], prompts, kv_cache_memory_bytes=16 << 20) == expected


def test_gpt_oss_gguf_lonely_expert_bias_is_refused(gpt_oss, tmp_path):
    """A file with an expert gate bias and no up bias is refused by name."""
    model, _, _ = gpt_oss
    path = tmp_path / "broken.gguf"
    write_gpt_oss_gguf(path, model, fused=False, drop="blk.2.ffn_up_exps.bias")
    with pytest.raises(ModelLoadError, match=r"layers\.2\.mlp\.experts: gate bias only"):
        list(iter_gguf_weights(str(path)))


# ----------------------------------------------------------------------------------------- Qwen2-MoE


def write_qwen2_moe_gguf(path: Path, model) -> None:
    """As convert_hf_to_gguf.py's Qwen2MoeModel: experts stacked [E, out, in] (transformers 5 keeps
    gate and up fused, gate rows first), the shared expert's widths in the metadata, its gate squeezed
    to a vector as the quantized files hold it."""
    cfg = model.config
    w = _writer(path, "qwen2moe", cfg)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)

    def special(name: str, a: np.ndarray) -> dict[str, np.ndarray] | None:
        blk = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else ""
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = np.split(a, 2, axis=1)
            return {f"{blk}.ffn_gate_exps.weight": gate, f"{blk}.ffn_up_exps.weight": up}
        if name.endswith("mlp.experts.down_proj"):
            return {f"{blk}.ffn_down_exps.weight": a}
        if name.endswith("shared_expert_gate.weight"):
            return {f"{blk}.ffn_gate_inp_shexp.weight": a.reshape(-1)}
        return None

    tensors = _mapped(model.state_dict(), gguf.MODEL_ARCH.QWEN2MOE, cfg.num_hidden_layers, special)
    quant = {
        "blk.0.ffn_down_exps.weight": Q.Q8_0,
        "blk.1.attn_k.weight": Q.Q8_0,
        "blk.2.ffn_up_shexp.weight": Q.Q8_0,
    }
    _finish(w, tensors, quant)


def test_qwen2_moe_gguf_token_exact(tmp_path):
    import transformers

    # llama.cpp's qwen2moe has no dense layers: every layer sparse
    cfg = transformers.Qwen2MoeConfig(**{**QWEN2_MOE_FIELDS, "mlp_only_layers": []})
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    _spread_weights(model, 0)
    _quantize_in_place(model.model.layers[0].mlp.experts.down_proj, Q.Q8_0, transposed=False)
    _quantize_in_place(model.model.layers[1].self_attn.k_proj.weight, Q.Q8_0, transposed=False)
    _quantize_in_place(model.model.layers[2].mlp.shared_expert.up_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / "qwen2moe.gguf"
    write_qwen2_moe_gguf(path, model)

    info = read_gguf(str(path))
    assert info.hf_architecture == "Qwen2MoeForCausalLM"
    hf_arch = resolve_source(str(tmp_path / "hf")).arch
    assert info.arch == hf_arch
    assert (info.arch.shared_expert_gated, info.arch.norm_topk_prob, info.arch.attention_bias) == (
        True,
        False,
        True,
    )
    llm = LLM(str(path), **ENGINE)
    check_waves_token_exact(llm, model, waves(cfg.vocab_size))


def test_qwen2_moe_gguf_without_shared_width_is_refused(tmp_path):
    path = tmp_path / "bad.gguf"
    cfg = SimpleNamespace(**{**QWEN2_MOE_FIELDS, "rope_parameters": {"rope_theta": 1e4}})
    w = _writer(path, "qwen2moe", cfg)
    w.add_expert_feed_forward_length(32)
    _finish(w, {"token_embd.weight": np.zeros((cfg.vocab_size, 64), np.float32)}, {})
    with pytest.raises(ModelLoadError, match="lacks qwen2moe.expert_shared_feed_forward_length"):
        read_gguf(str(path))


def test_unsupported_gguf_architecture_names_the_supported_ones(tmp_path):
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv7")
    _finish(w, {"token_embd.weight": np.zeros((8, 8), np.float32)}, {})
    with pytest.raises(ModelLoadError, match=r"'rwkv7' is not supported \(supported: .*gpt-oss.*qwen2moe"):
        read_gguf(str(path))


# --------------------------------------------------------------------------------------- DeepSeek-V2/V3


def write_deepseek2_gguf(path: Path, model, split_kv_b: bool) -> None:
    """As convert_hf_to_gguf.py's DeepseekV2Model: MLA as one latent KV head (key_length = kv_lora_rank +
    rope dims, the per-head widths in key_length_mla / value_length_mla), experts stacked, V3's sigmoid
    router as expert_gating_func 2 (the base class writes it from scoring_func), the YaRN log multiplier
    0.1 * mscale_all_dim; kv_b_proj split into attn_k_b / attn_v_b (newer converters) or kept whole."""
    cfg = model.config
    rope = cfg.rope_parameters
    w = _writer(
        path, "deepseek2", SimpleNamespace(**{**cfg.to_dict(), "num_key_value_heads": 1, "head_dim": None})
    )
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    v3 = cfg.model_type == "deepseek_v3"
    if v3:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if cfg.norm_topk_prob:
            w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])

    def special(name: str, a: np.ndarray) -> dict[str, np.ndarray] | None:
        blk = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else ""
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = np.split(a, 2, axis=1)
            return {f"{blk}.ffn_gate_exps.weight": gate, f"{blk}.ffn_up_exps.weight": up}
        if name.endswith("mlp.experts.down_proj"):
            return {f"{blk}.ffn_down_exps.weight": a}
        if name.endswith("kv_b_proj.weight") and split_kv_b:
            kv_b = a.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            k_b, v_b = np.split(kv_b, [cfg.qk_nope_head_dim], axis=1)
            return {f"{blk}.attn_k_b.weight": k_b.transpose(0, 2, 1), f"{blk}.attn_v_b.weight": v_b}
        return None

    tensors = _mapped(model.state_dict(), gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers, special)
    quant = {"blk.1.ffn_down_exps.weight": Q.Q8_0, "blk.2.attn_output.weight": Q.Q8_0}
    _finish(w, tensors, quant)


@pytest.mark.parametrize("variant,split_kv_b", [("v3", True), ("v2", False)])
def test_deepseek2_gguf_token_exact(tmp_path, variant, split_kv_b):
    import transformers

    from tests.test_deepseek import COMMON, VARIANTS

    family, fields = VARIANTS[variant]
    cfg = getattr(transformers, f"{family}Config")(**{**COMMON, **fields})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    _spread_weights(model, 0)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape))
    _quantize_in_place(model.model.layers[1].mlp.experts.down_proj, Q.Q8_0, transposed=False)
    _quantize_in_place(model.model.layers[2].self_attn.o_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"{variant}.gguf"
    write_deepseek2_gguf(path, model, split_kv_b)

    info = read_gguf(str(path))
    assert info.hf_architecture == f"{family}ForCausalLM"
    assert info.arch == resolve_source(str(tmp_path / "hf")).arch
    llm = LLM(str(path), **ENGINE)
    check_waves_token_exact(llm, model, waves(cfg.vocab_size))


# ------------------------------------------------------------------------ OLMoE, Seed-OSS, ERNIE 4.5

DENSE_AND_MOE = {
    # OLMoE: whole-projection q/k norms, 8 experts top-2 without renormalization
    "olmoe": (
        "Olmoe",
        gguf.MODEL_ARCH.OLMOE,
        dict(
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            rms_norm_eps=1e-5,
        ),
    ),
    # Seed-OSS: biases on q/k/v and on o_proj, head_dim apart from hidden / heads
    "seed_oss": (
        "SeedOss",
        gguf.MODEL_ARCH.SEED_OSS,
        dict(
            intermediate_size=96, head_dim=24, attention_bias=True, attention_out_bias=True, rms_norm_eps=1e-6
        ),
    ),
    "ernie4_5": (
        "Ernie4_5",
        gguf.MODEL_ARCH.ERNIE4_5,
        dict(intermediate_size=96, head_dim=16, use_bias=False),
    ),
    # ERNIE 4.5 MoE: the first layer dense, then experts plus a shared one, the softmax + correction-bias
    # router (every layer from the start sparse: llama.cpp's rule)
    "ernie4_5_moe": (
        "Ernie4_5_Moe",
        gguf.MODEL_ARCH.ERNIE4_5_MOE,
        dict(
            intermediate_size=96,
            head_dim=16,
            use_bias=False,
            moe_num_experts=8,
            moe_k=2,
            moe_intermediate_size=32,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=-1,
            moe_layer_interval=1,
        ),
    ),
}


def _ernie_moe_metadata(w: gguf.GGUFWriter, cfg) -> None:
    """What convert_hf_to_gguf.py's Ernie4_5MoeModel adds to the base metadata."""
    w.add_expert_count(cfg.moe_num_experts)
    w.add_expert_used_count(cfg.moe_k)
    w.add_interleave_moe_layer_step(cfg.moe_layer_interval)
    w.add_leading_dense_block_count(cfg.moe_layer_start_index)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.moe_num_shared_experts)


def _split_experts(name: str, a: np.ndarray) -> dict[str, np.ndarray] | None:
    """transformers 5's stacked experts ([E, 2I, H] gate rows first, [E, H, I]) as the converter stacks
    the per-expert tensors."""
    blk = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else ""
    if name.endswith("mlp.experts.gate_up_proj"):
        gate, up = np.split(a, 2, axis=1)
        return {f"{blk}.ffn_gate_exps.weight": gate, f"{blk}.ffn_up_exps.weight": up}
    if name.endswith("mlp.experts.down_proj"):
        return {f"{blk}.ffn_down_exps.weight": a}
    if name.endswith("gate.moe_statics.e_score_correction_bias"):  # transformers 5's name for ERNIE's
        return {f"{blk}.exp_probs_b.bias": a}
    return None


@pytest.mark.parametrize("variant", sorted(DENSE_AND_MOE))
def test_dense_and_moe_gguf_token_exact(tmp_path, variant):
    import transformers

    family, gguf_arch, fields = DENSE_AND_MOE[variant]
    common = dict(
        vocab_size=384, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    cfg = getattr(transformers, f"{family}Config")(**{**common, **fields})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    _spread_weights(model, 0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):  # transformers starts it at zeros
                param.copy_(0.05 * torch.randn(param.shape))
    _quantize_in_place(model.model.layers[1].self_attn.v_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"{variant}.gguf"
    w = _writer(path, gguf.MODEL_ARCH_NAMES[gguf_arch], cfg)
    if variant == "ernie4_5_moe":
        _ernie_moe_metadata(w, cfg)
    tensors = _mapped(model.state_dict(), gguf_arch, cfg.num_hidden_layers, _split_experts)
    _finish(w, tensors, {"blk.1.attn_v.weight": Q.Q8_0})

    info = read_gguf(str(path))
    assert info.hf_architecture == f"{family}ForCausalLM"
    assert info.arch == resolve_source(str(tmp_path / "hf")).arch
    llm = LLM(str(path), **ENGINE)
    check_waves_token_exact(llm, model, waves(cfg.vocab_size))


def _check_tokens(llm: LLM, ref, rounds) -> None:
    """tiny_moe.check_waves_token_exact for the tiny tied models, whose greedy tokens vary too little for
    its variety check: every prompt's tokens equal transformers', and so do the chosen tokens' logprobs
    (logit scale, norms and RoPE show there, not only in the argmax)."""
    from overnight import SamplingParams
    from tests.parity_helpers import hf_greedy
    from tests.tiny_moe import NEW_TOKENS

    prompts = [*rounds[0], *rounds[1]]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        expected, scores = hf_greedy(ref, prompt, NEW_TOKENS)
        got = out.outputs[0]
        assert list(got.token_ids) == expected, f"prompt of {len(prompt)} tokens"
        assert got.logprobs is not None
        for token, theirs, ours in zip(expected, scores, got.logprobs):
            assert ours[token].logprob == pytest.approx(float(theirs[token]), abs=1e-4)


# ------------------------------------------------------------------------------------------ EXAONE 4.0


def _llama3_rope_freqs(cfg) -> np.ndarray:
    """The per-frequency divisors the converter writes as rope_freqs.weight for Llama 3 RoPE scaling."""
    rope = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_exaone4_gguf_token_exact(tmp_path):
    """The 32B's shape: sliding / full without RoPE / sliding, Llama 3 RoPE as rope_freqs."""
    variant = "exaone4"
    from tests.dense_family_checks import make_model

    # Llama 3 scaling with two frequencies between its bands, the least rope_freqs recovers it from
    changes = {}
    if variant == "exaone4":
        rope = dict(
            rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=8.0
        )
        changes["rope_parameters"] = {**rope, "original_max_position_embeddings": 128}
    model = make_model(variant, **changes)
    cfg = model.config
    _quantize_in_place(model.model.layers[2].mlp.down_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"{variant}.gguf"
    w = _writer(path, "exaone4", cfg)
    w.add_vocab_size(cfg.vocab_size)
    extra = {}
    if cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if cfg.rope_parameters.get("rope_type") == "llama3":
        extra["rope_freqs.weight"] = _llama3_rope_freqs(cfg)
    sd = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight")  # a tied checkpoint has none
    tensors = _mapped(sd, gguf.MODEL_ARCH.EXAONE4, cfg.num_hidden_layers, lambda name, a: None)
    _finish(w, {**tensors, **extra}, {"blk.2.ffn_down.weight": Q.Q8_0})

    info = read_gguf(str(path))
    assert info.hf_architecture == "Exaone4ForCausalLM"
    hf = resolve_source(str(tmp_path / "hf")).arch
    # The divisors fix Llama 3's band only up to an equivalent (orig, low, high): the factor is the same,
    # and the frequencies it gives (every position's rotation) are checked by the tokens.
    assert dict(info.arch.rope_scaling or {}).get("factor") == dict(hf.rope_scaling or {}).get("factor")
    assert dataclasses.replace(info.arch, rope_scaling=hf.rope_scaling) == hf
    llm = LLM(str(path), **ENGINE)
    check_waves_token_exact(llm, model, waves(cfg.vocab_size))


# ----------------------------------------------------------------------------- Command R, Cohere 2


@pytest.mark.parametrize("variant", ["cohere", "cohere-plus", "cohere2"])
def test_cohere_gguf_token_exact(tmp_path, variant):
    """Command R (tied, logit scale), R+ (per-head q/k norms) and Cohere 2 with llama.cpp's fixed window
    pattern (three sliding layers, then a full one without RoPE)."""
    from tests.dense_family_checks import make_model

    # Cohere 2's files are always tied (llama.cpp's cohere2 has no output tensor)
    changes = (
        dict(num_hidden_layers=4, sliding_window_pattern=4, tie_word_embeddings=True)
        if variant == "cohere2"
        else {}
    )
    model = make_model(variant, **changes)
    cfg = model.config
    _quantize_in_place(model.model.layers[1].self_attn.o_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"{variant}.gguf"
    arch = "cohere2" if variant == "cohere2" else "command-r"
    w = _writer(path, arch, SimpleNamespace(**{**cfg.to_dict(), "head_dim": None}))
    w.add_layer_norm_eps(cfg.layer_norm_eps)
    w.add_logit_scale(cfg.logit_scale)
    if variant == "cohere2":
        w.add_sliding_window(cfg.sliding_window)
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    sd = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight")
    gguf_arch = gguf.MODEL_ARCH.COHERE2 if variant == "cohere2" else gguf.MODEL_ARCH.COMMAND_R
    tensors = _mapped(sd, gguf_arch, cfg.num_hidden_layers, lambda name, a: None)
    _finish(w, tensors, {"blk.1.attn_output.weight": Q.Q8_0})

    info = read_gguf(str(path))
    assert info.hf_architecture == ("Cohere2ForCausalLM" if variant == "cohere2" else "CohereForCausalLM")
    assert info.arch == resolve_source(str(tmp_path / "hf")).arch
    _check_tokens(LLM(str(path), **ENGINE), model, waves(cfg.vocab_size))


def test_unsupported_tensor_type_is_refused_before_loading(tmp_path):
    """A tensor type the gguf package cannot dequantize (Q8_1, llama.cpp's activation-only type) is named
    when the file is read, before any model is built."""
    from tests.dense_family_checks import make_model

    model = make_model("seed_oss")
    path = tmp_path / "q8_1.gguf"
    w = _writer(path, "seed_oss", model.config)
    tensors = _mapped(
        model.state_dict(), gguf.MODEL_ARCH.SEED_OSS, model.config.num_hidden_layers, lambda n, a: None
    )
    raw = np.zeros((96, 64 // 32 * 40), dtype=np.uint8)  # [96, 64] in Q8_1 blocks of 32 values, 40 bytes
    del tensors["blk.1.ffn_up.weight"]
    for name, a in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.add_tensor("blk.1.ffn_up.weight", raw, raw_dtype=Q.Q8_1)
    _finish(w, {}, {})
    with pytest.raises(
        ModelLoadError, match=r"type Q8_1 cannot be dequantized \(first: blk\.1\.ffn_up\.weight\)"
    ):
        read_gguf(str(path))


# ------------------------------------------------------------------------------------------------ LFM2


def test_lfm2_gguf_token_exact(tmp_path):
    """LFM2 as convert_hf_to_gguf.py's LFM2Model writes it: a KV head count per layer (0 for the short-conv
    layers), the conv cache length, the adjusted feed-forward width, the conv kernel squeezed to [C, L],
    the final norm as token_embd_norm; tied embeddings."""
    import transformers

    cfg = transformers.Lfm2Config(
        vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "full_attention"],
        block_auto_adjust_ff_dim=False, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Lfm2ForCausalLM(cfg).eval()
    _spread_weights(model, 0)
    _quantize_in_place(model.model.layers[0].conv.in_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / "lfm2.gguf"
    counts = [cfg.num_key_value_heads if t != "conv" else 0 for t in cfg.layer_types]
    w = _writer(path, "lfm2", SimpleNamespace(**{**cfg.to_dict(), "num_key_value_heads": counts}))
    w.add_vocab_size(cfg.vocab_size)
    w.add_shortconv_l_cache(cfg.conv_L_cache)
    w.add_layer_norm_rms_eps(cfg.norm_eps)

    def special(name: str, a: np.ndarray) -> dict[str, np.ndarray] | None:
        if name.endswith("conv.conv.weight"):
            return {f"blk.{name.split('.')[2]}.shortconv.conv.weight": a.squeeze(1)}
        return None

    sd = dict(model.state_dict())
    sd.pop("lm_head.weight")  # tied
    tensors = _mapped(sd, gguf.MODEL_ARCH.LFM2, cfg.num_hidden_layers, special)
    _finish(w, tensors, {"blk.0.shortconv.in_proj.weight": Q.Q8_0})

    info = read_gguf(str(path))
    assert info.hf_architecture == "Lfm2ForCausalLM"
    assert info.arch == resolve_source(str(tmp_path / "hf")).arch
    _check_tokens(LLM(str(path), **ENGINE), model, waves(cfg.vocab_size))
