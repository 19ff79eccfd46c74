"""GGUF files of the hybrid families (loader/gguf_families.py): LFM2 and LFM2-MoE (short-conv layers),
Granite 4.0-H and Nemotron-H (Mamba2 layers), written from tiny random transformers models the way
llama.cpp's converter writes them (tests/gguf_writers.py: its squeezes and reshapes, A stored as
-exp(A_log), q/k rows permuted), one tensor each in Q8_0 (the reference model holding the round-tripped
values): the arch read back equals the HF folder's, and the engine's greedy tokens and their logprobs
equal transformers' in fp32."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from overnight import LLM
from overnight.loader.gguf_config import read_gguf
from overnight.loader.resolve import resolve_source
from tests.gguf_writers import check_tokens, converter_writer, finish, mapped, quantize_in_place
from tests.tiny_models import _spread_weights
from tests.tiny_moe import ENGINE, waves

pytestmark = pytest.mark.slow  # engines beside transformers

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
    quantize_in_place(model.model.layers[0].conv.in_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / "lfm2.gguf"
    counts = [cfg.num_key_value_heads if t != "conv" else 0 for t in cfg.layer_types]
    w = converter_writer(path, "lfm2", SimpleNamespace(**{**cfg.to_dict(), "num_key_value_heads": counts}))
    w.add_vocab_size(cfg.vocab_size)
    w.add_shortconv_l_cache(cfg.conv_L_cache)
    w.add_layer_norm_rms_eps(cfg.norm_eps)

    def special(name: str, a: np.ndarray) -> dict[str, np.ndarray] | None:
        if name.endswith("conv.conv.weight"):
            return {f"blk.{name.split('.')[2]}.shortconv.conv.weight": a.squeeze(1)}
        return None

    sd = dict(model.state_dict())
    sd.pop("lm_head.weight")  # tied
    tensors = mapped(sd, gguf.MODEL_ARCH.LFM2, cfg.num_hidden_layers, special)
    finish(w, tensors, {"blk.0.shortconv.in_proj.weight": Q.Q8_0})

    info = read_gguf(str(path))
    assert info.hf_architecture == "Lfm2ForCausalLM"
    assert info.arch == resolve_source(str(tmp_path / "hf")).arch
    check_tokens(LLM(str(path), **ENGINE), model, waves(cfg.vocab_size))


def test_lfm2_moe_gguf_token_exact(tmp_path):
    """LFM2-MoE as convert_hf_to_gguf.py's LFM2MoeModel writes it: LFM2's layout, the leading dense
    layer count, the experts stacked, the router's bias as exp_probs_b.bias."""
    import transformers

    cfg = transformers.Lfm2MoeConfig(
        vocab_size=211, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "full_attention"],
        num_dense_layers=1, num_experts=8, num_experts_per_tok=2, max_position_embeddings=512, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Lfm2MoeForCausalLM(cfg).eval()
    _spread_weights(model, 0)
    with torch.no_grad():
        for name, buffer in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("expert_bias"):  # transformers starts it at zeros
                buffer.copy_(0.3 * torch.randn(buffer.shape))
    quantize_in_place(model.model.layers[2].feed_forward.experts.down_proj, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / "lfm2moe.gguf"
    counts = [cfg.num_key_value_heads if t != "conv" else 0 for t in cfg.layer_types]
    w = converter_writer(path, "lfm2moe", SimpleNamespace(**{**cfg.to_dict(), "num_key_value_heads": counts}))
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_leading_dense_block_count(cfg.num_dense_layers)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_vocab_size(cfg.vocab_size)
    w.add_shortconv_l_cache(cfg.conv_L_cache)
    w.add_layer_norm_rms_eps(cfg.norm_eps)

    def special(name: str, a: np.ndarray) -> dict[str, np.ndarray] | None:
        blk = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else ""
        if name.endswith("conv.conv.weight"):
            return {f"{blk}.shortconv.conv.weight": a.squeeze(1)}
        if name.endswith("experts.gate_up_proj"):
            gate, up = np.split(a, 2, axis=1)
            return {f"{blk}.ffn_gate_exps.weight": gate, f"{blk}.ffn_up_exps.weight": up}
        if name.endswith("experts.down_proj"):
            return {f"{blk}.ffn_down_exps.weight": a}
        if name.endswith("feed_forward.expert_bias"):
            return {f"{blk}.exp_probs_b.bias": a}
        return None

    sd = dict(model.state_dict())
    sd.pop("lm_head.weight")  # tied
    tensors = mapped(sd, gguf.MODEL_ARCH.LFM2MOE, cfg.num_hidden_layers, special)
    finish(w, tensors, {"blk.2.ffn_down_exps.weight": Q.Q8_0})

    info = read_gguf(str(path))
    assert info.hf_architecture == "Lfm2MoeForCausalLM"
    assert info.arch == resolve_source(str(tmp_path / "hf")).arch
    check_tokens(LLM(str(path), **ENGINE), model, waves(cfg.vocab_size))


# -------------------------------------------------------------------------------------- Granite 4.0-H


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_granite_hybrid_gguf_token_exact(tmp_path, variant):
    """Granite 4.0-H as convert_hf_to_gguf.py's GraniteHybridModel writes it: Mamba2 layers with A as
    -exp(A_log) and A, D, the gated norm reshaped, the conv kernel squeezed; q/k rows permuted as for
    llama; the shared MLP (and the experts') gate / up split; Granite's multipliers; a KV head count
    per layer (0 for Mamba2 layers); no RoPE (the converter's rule for hybrids)."""
    from tests.test_gguf import converter_permute
    from tests.tiny_granite import make_granite_model

    model = make_granite_model(variant, position_embedding_type="nope")
    cfg = model.config
    quantize_in_place(model.model.layers[0].mamba.out_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"granite-{variant}.gguf"
    attn = [t == "full_attention" for t in cfg.layer_types]
    counts = [cfg.num_key_value_heads if a else 0 for a in attn]
    w = converter_writer(
        path, "granitehybrid", SimpleNamespace(**{**cfg.to_dict(), "num_key_value_heads": counts})
    )
    w.add_float32("granitehybrid.attention.scale", cfg.attention_multiplier)
    w.add_float32("granitehybrid.embedding_scale", cfg.embedding_multiplier)
    w.add_float32("granitehybrid.residual_scale", cfg.residual_multiplier)
    w.add_float32("granitehybrid.logit_scale", cfg.logits_scaling)
    w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    inner = cfg.mamba_expand * cfg.hidden_size
    w.add_ssm_conv_kernel(cfg.mamba_d_conv)
    w.add_ssm_state_size(cfg.mamba_d_state)
    w.add_ssm_group_count(cfg.mamba_n_groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(cfg.mamba_n_heads)
    w.add_rope_scaling_finetuned(False)
    moe = bool(cfg.num_local_experts)

    def special(name: str, a: np.ndarray) -> dict[str, np.ndarray] | None:
        if not name.startswith("model.layers."):
            return None
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}"
        if rest == "self_attn.q_proj.weight":
            return {f"{blk}.attn_q.weight": converter_permute(a, cfg.num_attention_heads)}
        if rest == "self_attn.k_proj.weight":
            return {f"{blk}.attn_k.weight": converter_permute(a, cfg.num_key_value_heads)}
        if rest == "block_sparse_moe.experts.gate_up_proj":
            gate, up = np.split(a, 2, axis=1)
            return {f"{blk}.ffn_gate_exps.weight": gate, f"{blk}.ffn_up_exps.weight": up}
        if rest == "block_sparse_moe.experts.down_proj":
            return {f"{blk}.ffn_down_exps.weight": a}
        if rest == "block_sparse_moe.router.weight":
            return {f"{blk}.ffn_gate_inp.weight": a}
        if rest == "shared_mlp.input_linear.weight":
            gate, up = np.split(a, 2, axis=0)
            kind = "shexp" if moe else ""
            return {
                f"{blk}.ffn_gate{'_' + kind if kind else ''}.weight": gate,
                f"{blk}.ffn_up{'_' + kind if kind else ''}.weight": up,
            }
        if rest == "shared_mlp.output_linear.weight":
            return {f"{blk}.ffn_down{'_shexp' if moe else ''}.weight": a}
        mamba = {  # the converter's Mamba2 reshapes, and A = -exp(A_log)
            "mamba.in_proj.weight": ("ssm_in.weight", lambda: a),
            "mamba.conv1d.weight": ("ssm_conv1d.weight", lambda: a.squeeze(1)),
            "mamba.conv1d.bias": ("ssm_conv1d.bias", lambda: a),
            "mamba.dt_bias": ("ssm_dt.bias", lambda: a),
            "mamba.A_log": ("ssm_a", lambda: -np.exp(a).reshape(-1, 1)),
            "mamba.D": ("ssm_d", lambda: a.reshape(-1, 1)),
            "mamba.norm.weight": ("ssm_norm.weight", lambda: a.reshape(cfg.mamba_n_groups, -1)),
            "mamba.out_proj.weight": ("ssm_out.weight", lambda: a),
        }
        if rest in mamba:
            new, value = mamba[rest]
            return {f"{blk}.{new}": value()}
        return None

    tensors = mapped(dict(model.state_dict()), gguf.MODEL_ARCH.GRANITE_HYBRID, cfg.num_hidden_layers, special)
    finish(w, tensors, {"blk.0.ssm_out.weight": Q.Q8_0})

    info = read_gguf(str(path))
    assert info.hf_architecture == "GraniteMoeHybridForCausalLM"
    hf = resolve_source(str(tmp_path / "hf")).arch
    assert dataclasses.replace(info.arch, max_position_embeddings=hf.max_position_embeddings) == hf
    engine = {**ENGINE, "max_model_len": 256}
    check_tokens(LLM(str(path), **engine), model, waves(cfg.vocab_size))


def test_nemotron_h_gguf_token_exact(tmp_path):
    """Nemotron-H as the converter writes it (Granite 4.0-H's converter underneath): the block pattern
    only in the per-layer KV head counts and feed-forward widths, the Mamba2 forms, q/k permuted."""
    from tests.test_gguf import converter_permute
    from tests.tiny_nemotron_h import make_nemotron_h_model

    model = make_nemotron_h_model()
    cfg = model.config
    quantize_in_place(model.model.layers[1].mixer.in_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / "nemotron-h.gguf"
    pattern = cfg.hybrid_override_pattern
    n = len(pattern)
    fields = {**cfg.to_dict(), "num_hidden_layers": n, "intermediate_size": 0}
    fields["num_key_value_heads"] = [cfg.num_key_value_heads if c == "*" else 0 for c in pattern]
    w = converter_writer(path, "nemotron_h", SimpleNamespace(**fields))
    w.add_feed_forward_length([cfg.intermediate_size if c == "-" else 0 for c in pattern])
    w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_state_size(cfg.ssm_state_size)
    w.add_ssm_group_count(cfg.n_groups)
    w.add_ssm_inner_size(cfg.mamba_num_heads * cfg.mamba_head_dim)
    w.add_ssm_time_step_rank(cfg.mamba_num_heads)
    w.add_rope_scaling_finetuned(False)
    gguf_names = {
        "norm.weight": "attn_norm.weight", "mixer.q_proj.weight": "attn_q.weight",
        "mixer.k_proj.weight": "attn_k.weight", "mixer.v_proj.weight": "attn_v.weight",
        "mixer.o_proj.weight": "attn_output.weight", "mixer.up_proj.weight": "ffn_up.weight",
        "mixer.down_proj.weight": "ffn_down.weight", "mixer.in_proj.weight": "ssm_in.weight",
        "mixer.conv1d.weight": "ssm_conv1d.weight", "mixer.conv1d.bias": "ssm_conv1d.bias",
        "mixer.dt_bias": "ssm_dt.bias", "mixer.A_log": "ssm_a", "mixer.D": "ssm_d",
        "mixer.norm.weight": "ssm_norm.weight", "mixer.out_proj.weight": "ssm_out.weight",
    }  # fmt: skip
    tensors = {}
    for name, t in model.state_dict().items():
        a = t.numpy().astype(np.float32)
        if not name.startswith("model.layers."):
            glob = {"model.embeddings.weight": "token_embd", "model.norm_f.weight": "output_norm"}
            tensors[glob.get(name, "output") + ".weight"] = a
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mixer.q_proj.weight":
            a = converter_permute(a, cfg.num_attention_heads)
        elif rest == "mixer.k_proj.weight":
            a = converter_permute(a, cfg.num_key_value_heads)
        elif rest == "mixer.conv1d.weight":
            a = a.squeeze(1)
        elif rest == "mixer.A_log":
            a = -np.exp(a).reshape(-1, 1)
        elif rest == "mixer.D":
            a = a.reshape(-1, 1)
        elif rest == "mixer.norm.weight":
            a = a.reshape(cfg.n_groups, -1)
        tensors[f"blk.{layer}.{gguf_names[rest]}"] = a
    finish(w, tensors, {"blk.1.ssm_in.weight": Q.Q8_0})

    info = read_gguf(str(path))
    assert info.hf_architecture == "NemotronHForCausalLM"
    assert info.arch == resolve_source(str(tmp_path / "hf")).arch
    check_tokens(LLM(str(path), **ENGINE), model, waves(cfg.vocab_size))
