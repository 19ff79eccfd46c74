"""GGUF files of OLMoE, Seed-OSS, ERNIE 4.5 (dense and MoE), EXAONE 4.0, Command R / R+ / Cohere 2 and
LFM2 (loader/gguf_families.py), written from tiny random transformers models the way llama.cpp's
converter writes them (tests/gguf_writers.py), one tensor each in Q8_0 (the reference model holding the
round-tripped values): the arch read back equals the HF folder's and the engine's greedy tokens equal
transformers' in fp32. Also: a tensor type the gguf package cannot dequantize is refused on reading."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from overnight import LLM
from overnight.errors import ModelLoadError
from overnight.loader.gguf import read_gguf
from overnight.loader.resolve import resolve_source
from tests.gguf_writers import (
    check_tokens,
    converter_writer,
    finish,
    mapped,
    quantize_in_place,
    split_experts,
)
from tests.tiny_models import _spread_weights
from tests.tiny_moe import ENGINE, check_waves_token_exact, waves

pytestmark = pytest.mark.slow  # engines beside transformers

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
    quantize_in_place(model.model.layers[1].self_attn.v_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"{variant}.gguf"
    w = converter_writer(path, gguf.MODEL_ARCH_NAMES[gguf_arch], cfg)
    if variant == "ernie4_5_moe":
        _ernie_moe_metadata(w, cfg)
    tensors = mapped(model.state_dict(), gguf_arch, cfg.num_hidden_layers, split_experts)
    finish(w, tensors, {"blk.1.attn_v.weight": Q.Q8_0})

    info = read_gguf(str(path))
    assert info.hf_architecture == f"{family}ForCausalLM"
    assert info.arch == resolve_source(str(tmp_path / "hf")).arch
    llm = LLM(str(path), **ENGINE)
    check_waves_token_exact(llm, model, waves(cfg.vocab_size))


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
    quantize_in_place(model.model.layers[2].mlp.down_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"{variant}.gguf"
    w = converter_writer(path, "exaone4", cfg)
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
    tensors = mapped(sd, gguf.MODEL_ARCH.EXAONE4, cfg.num_hidden_layers, lambda name, a: None)
    finish(w, {**tensors, **extra}, {"blk.2.ffn_down.weight": Q.Q8_0})

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
    quantize_in_place(model.model.layers[1].self_attn.o_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"{variant}.gguf"
    arch = "cohere2" if variant == "cohere2" else "command-r"
    w = converter_writer(path, arch, SimpleNamespace(**{**cfg.to_dict(), "head_dim": None}))
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
    tensors = mapped(sd, gguf_arch, cfg.num_hidden_layers, lambda name, a: None)
    finish(w, tensors, {"blk.1.attn_output.weight": Q.Q8_0})

    info = read_gguf(str(path))
    assert info.hf_architecture == ("Cohere2ForCausalLM" if variant == "cohere2" else "CohereForCausalLM")
    assert info.arch == resolve_source(str(tmp_path / "hf")).arch
    check_tokens(LLM(str(path), **ENGINE), model, waves(cfg.vocab_size))


def test_unsupported_tensor_type_is_refused_before_loading(tmp_path):
    """A tensor type the gguf package cannot dequantize (Q8_1, llama.cpp's activation-only type) is named
    when the file is read, before any model is built."""
    from tests.dense_family_checks import make_model

    model = make_model("seed_oss")
    path = tmp_path / "q8_1.gguf"
    w = converter_writer(path, "seed_oss", model.config)
    tensors = mapped(
        model.state_dict(), gguf.MODEL_ARCH.SEED_OSS, model.config.num_hidden_layers, lambda n, a: None
    )
    raw = np.zeros((96, 64 // 32 * 40), dtype=np.uint8)  # [96, 64] in Q8_1 blocks of 32 values, 40 bytes
    del tensors["blk.1.ffn_up.weight"]
    for name, a in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.add_tensor("blk.1.ffn_up.weight", raw, raw_dtype=Q.Q8_1)
    finish(w, {}, {})
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
