"""GGUF files of gpt-oss, Qwen1.5-MoE / Qwen2-MoE and DeepSeek-V2 / V3 (loader/gguf_families.py),
written here from tiny random transformers models the way llama.cpp's converter writes them
(tests/gguf_writers.py): tensor names from gguf-py's own tensor map, gpt-oss's gate/up de-interleaved
(or fused, gate rows then up rows) and its experts in ggml's MXFP4, stacked experts, DeepSeek's kv_b
whole or split into k_b / v_b, some tensors in Q8_0. The quantized tensors of the reference model are
replaced by their round trip through the same quantizer first, so the engine on the GGUF file must give
transformers' greedy tokens exactly (fp32), and the arch read back must equal the one read from the HF
folder."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.layers.moe import Experts
from overnight.loader.gguf import iter_gguf_weights
from overnight.loader.gguf_config import read_gguf
from overnight.loader.gguf_tensors import mxfp4_to_checkpoint
from overnight.loader.resolve import resolve_source
from overnight.quant.mxfp4 import dequantize_mxfp4
from tests.gguf_writers import converter_writer, finish, mapped, quantize_in_place
from tests.test_gpt_oss import NEW_TOKENS, _config, _hf_greedy, _prompts, _spread
from tests.test_qwen2_moe import FIELDS as QWEN2_MOE_FIELDS
from tests.tiny_models import _spread_weights
from tests.tiny_moe import ENGINE, check_waves_token_exact, waves

pytestmark = pytest.mark.slow  # engines beside transformers

# ---------------------------------------------------------------------------------------------- gpt-oss


def write_gpt_oss_gguf(path: Path, model, fused: bool, drop: str = "", mxfp4: bool = True) -> None:
    """As convert_hf_to_gguf.py's GptOssModel: gate/up de-interleaved ([E, in, out] -> [E, out, in]),
    split into ffn_gate_exps / ffn_up_exps or fused gate-then-up, biases likewise; experts in MXFP4
    (or, mxfp4=False, in float32 as a file whose experts were requantized away from MXFP4)."""
    cfg = model.config
    rope = cfg.rope_parameters
    w = converter_writer(path, "gpt-oss", cfg)
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

    tensors = mapped(model.state_dict(), gguf.MODEL_ARCH.GPT_OSS, cfg.num_hidden_layers, special)
    tensors.pop(drop, None)
    quant = {n: Q.MXFP4 for n in tensors if "_exps.weight" in n and mxfp4}
    quant["blk.1.attn_q.weight"] = Q.Q8_0
    finish(w, tensors, quant)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(the reference model with the file's quantized values, its HF folder, the two GGUF files)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(_config()).eval()
    _spread(model, 0)
    for layer in model.model.layers:
        quantize_in_place(layer.mlp.experts.gate_up_proj, Q.MXFP4, transposed=True)
        quantize_in_place(layer.mlp.experts.down_proj, Q.MXFP4, transposed=True)
    quantize_in_place(model.model.layers[1].self_attn.q_proj.weight, Q.Q8_0, transposed=False)
    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    model.save_pretrained(root / "hf")
    files = {}
    for fused, mxfp4 in LAYOUTS:
        files[fused, mxfp4] = (
            root / f"gpt-oss-{'fused' if fused else 'split'}-{'mxfp4' if mxfp4 else 'f32'}.gguf"
        )
        write_gpt_oss_gguf(files[fused, mxfp4], model, fused, mxfp4=mxfp4)
    return model, root / "hf", files


LAYOUTS = [(False, True), (True, True), (False, False)]  # (fused gate/up, MXFP4 experts)


@pytest.mark.parametrize("fused,mxfp4", LAYOUTS)
def test_gpt_oss_gguf_token_exact(gpt_oss, fused, mxfp4):
    """MXFP4 experts stay packed (the published checkpoints' form: uint8 blocks in the model), others
    are dequantized; either way the tokens are transformers'."""
    model, folder, files = gpt_oss
    info = read_gguf(str(files[fused, mxfp4]))
    assert info.hf_architecture == "GptOssForCausalLM"
    assert info.arch.experts_mxfp4 is mxfp4
    assert dataclasses.replace(info.arch, experts_mxfp4=False) == resolve_source(str(folder)).arch
    assert info.arch.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert dict(info.arch.rope_scaling or ())["truncate"] is False
    prompts = _prompts(model.config.vocab_size)
    expected = [_hf_greedy(model, p) for p in prompts]
    assert len({tuple(e) for e in expected}) > 1
    # packed, and (MXFP4 files) dequantized at load as mxfp4_experts dense does on a GPU with room
    for form in ("auto", "dense") if mxfp4 else ("auto",):
        llm = LLM(
            str(files[fused, mxfp4]),
            skip_tokenizer_init=True,
            dtype="float32",
            kv_cache_memory_bytes=16 << 20,
            mxfp4_experts=form,
        )
        experts = next(m for m in llm.engine.runner.model.modules() if isinstance(m, Experts))  # type: ignore[attr-defined]
        assert (experts.gate_up_proj.dtype == torch.uint8) is (mxfp4 and form == "auto")
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, form


def test_ggml_mxfp4_repacks_to_the_checkpoint_layout():
    """ggml's MXFP4 bytes -> the OCP checkpoint's blocks and scales: the same values as both
    dequantizers give (gguf's and quant/mxfp4.py's)."""
    a = np.random.default_rng(0).standard_normal((3, 5, 64)).astype(np.float32) * 3
    raw = gguf.quants.quantize(a, Q.MXFP4)  # [3, 5, 2 * 17]
    blocks, scales = mxfp4_to_checkpoint(raw)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    ours = dequantize_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales), torch.float32)
    np.testing.assert_array_equal(ours.numpy(), gguf.quants.dequantize(raw, Q.MXFP4))


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
    w = converter_writer(path, "qwen2moe", cfg)
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

    tensors = mapped(model.state_dict(), gguf.MODEL_ARCH.QWEN2MOE, cfg.num_hidden_layers, special)
    quant = {
        "blk.0.ffn_down_exps.weight": Q.Q8_0,
        "blk.1.attn_k.weight": Q.Q8_0,
        "blk.2.ffn_up_shexp.weight": Q.Q8_0,
    }
    finish(w, tensors, quant)


def test_qwen2_moe_gguf_token_exact(tmp_path):
    import transformers

    # llama.cpp's qwen2moe has no dense layers: every layer sparse
    cfg = transformers.Qwen2MoeConfig(**{**QWEN2_MOE_FIELDS, "mlp_only_layers": []})
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    _spread_weights(model, 0)
    quantize_in_place(model.model.layers[0].mlp.experts.down_proj, Q.Q8_0, transposed=False)
    quantize_in_place(model.model.layers[1].self_attn.k_proj.weight, Q.Q8_0, transposed=False)
    quantize_in_place(model.model.layers[2].mlp.shared_expert.up_proj.weight, Q.Q8_0, transposed=False)
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
    w = converter_writer(path, "qwen2moe", cfg)
    w.add_expert_feed_forward_length(32)
    finish(w, {"token_embd.weight": np.zeros((cfg.vocab_size, 64), np.float32)}, {})
    with pytest.raises(ModelLoadError, match="lacks qwen2moe.expert_shared_feed_forward_length"):
        read_gguf(str(path))


def test_unsupported_gguf_architecture_names_the_supported_ones(tmp_path):
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv7")
    finish(w, {"token_embd.weight": np.zeros((8, 8), np.float32)}, {})
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
    w = converter_writer(
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

    tensors = mapped(model.state_dict(), gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers, special)
    quant = {"blk.1.ffn_down_exps.weight": Q.Q8_0, "blk.2.attn_output.weight": Q.Q8_0}
    finish(w, tensors, quant)


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
    quantize_in_place(model.model.layers[1].mlp.experts.down_proj, Q.Q8_0, transposed=False)
    quantize_in_place(model.model.layers[2].self_attn.o_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"{variant}.gguf"
    write_deepseek2_gguf(path, model, split_kv_b)

    info = read_gguf(str(path))
    assert info.hf_architecture == f"{family}ForCausalLM"
    assert info.arch == resolve_source(str(tmp_path / "hf")).arch
    llm = LLM(str(path), **ENGINE)
    check_waves_token_exact(llm, model, waves(cfg.vocab_size))
