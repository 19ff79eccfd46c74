"""From a HF config.json to a ModelArch and the class that implements it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.models.apertus import ApertusForCausalLM
from overnight.models.bert import BertModel
from overnight.models.bert_classifier import BertForSequenceClassification
from overnight.models.cohere import CohereForCausalLM
from overnight.models.deepseek import DeepseekForCausalLM
from overnight.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM
from overnight.models.falcon_h1 import FalconH1ForCausalLM, falcon_h1_arch
from overnight.models.field_readers import checked_rope, rope_params
from overnight.models.gemma import GemmaForCausalLM
from overnight.models.gemma4 import Gemma4ForCausalLM
from overnight.models.gemma_config import gemma_arch
from overnight.models.gemma_encoder import GemmaEncoderModel
from overnight.models.gemma_vl import Gemma3ForConditionalGeneration
from overnight.models.glm4_moe import Glm4MoeForCausalLM
from overnight.models.gpt_oss import GptOssForCausalLM
from overnight.models.granite_hybrid import GraniteMoeHybridForCausalLM, granite_hybrid_arch
from overnight.models.hf_config import TEXT_CONFIG_FAMILIES, WINDOWED_FAMILIES, family_fields, text_config
from overnight.models.hunyuan import HunYuanForCausalLM
from overnight.models.internvl import InternVLForConditionalGeneration, InternVLMoeForConditionalGeneration
from overnight.models.lfm2 import Lfm2ForCausalLM, lfm2_arch
from overnight.models.llama import LlamaForCausalLM, Mistral3ForConditionalGeneration
from overnight.models.llama4 import Llama4ForCausalLM
from overnight.models.llama4_config import llama4_arch
from overnight.models.llama4_vl import Llama4ForConditionalGeneration
from overnight.models.minimax_m2 import MiniMaxM2ForCausalLM
from overnight.models.mistral3_vl import Mistral3VLForConditionalGeneration
from overnight.models.mixtral import MixtralForCausalLM
from overnight.models.modernbert import ModernBertForSequenceClassification, ModernBertModel, modernbert_arch
from overnight.models.nemotron_h import NemotronHForCausalLM, nemotron_h_arch
from overnight.models.nomic_bert import NomicBertModel, nomic_arch
from overnight.models.olmo import OlmoForCausalLM
from overnight.models.qwen3_5_vl import Qwen3_5ForConditionalGeneration, with_vision
from overnight.models.qwen3_moe import Qwen3MoeForCausalLM
from overnight.models.qwen3_next import HYBRID_FAMILIES, Qwen3NextForCausalLM, hybrid_arch
from overnight.models.qwen_vl import (
    Glm4vForConditionalGeneration,
    Glm4vMoeForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
    QwenVLForConditionalGeneration,
)
from overnight.models.smolvlm import Idefics3ForConditionalGeneration, idefics3_arch
from overnight.models.vision.config import (
    glm4v_vision_arch,
    internvl_vision_arch,
    mistral3_vision_arch,
    text_config_of,
    vision_arch_from_hf,
)

# ModelArch.architecture (the HF model_type) -> implementation. One class per family shape: the dense
# families differ only in ModelArch flags.
_FAMILIES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen2_moe": Qwen3MoeForCausalLM,  # with Qwen2's attention and a gated shared expert (flags)
    "ernie4_5": LlamaForCausalLM,  # interleaved RoPE (a flag)
    "ernie4_5_moe": Ernie4_5_MoeForCausalLM,
    "olmoe": Qwen3MoeForCausalLM,  # whole-projection q/k norms, every layer sparse (flags)
    "hunyuan_v1_dense": HunYuanForCausalLM,
    "hunyuan_v1_moe": HunYuanForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "bert": BertModel,
    "xlm-roberta": BertModel,  # BERT's blocks; positions past the padding id (ModelArch.position_offset)
    "modernbert": ModernBertModel,
    "nomic_bert": NomicBertModel,
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
    "gemma4": Gemma4ForCausalLM,
    # The dense families of issue 32: Llama's decoder with per-layer windows / RoPE and block options
    # (ModelArch fields read by _FAMILY_FIELDS below), OLMo's post-norm blocks, Mixtral's experts.
    "mistral": LlamaForCausalLM,
    "ministral3": LlamaForCausalLM,
    "mistral3": Mistral3ForConditionalGeneration,
    "mixtral": MixtralForCausalLM,
    "phi3": LlamaForCausalLM,
    "olmo2": OlmoForCausalLM,
    "olmo3": OlmoForCausalLM,
    "smollm3": LlamaForCausalLM,
    "granite": LlamaForCausalLM,
    "glm4": LlamaForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "minimax_m2": MiniMaxM2ForCausalLM,
    # Llama's attention with other blocks: Seed-OSS (o_proj's own bias flag), EXAONE 4 (OLMo's post-norm
    # blocks, per-head q/k norms, NoPE full layers), Apertus (xIELU MLP), Cohere (parallel blocks)
    "seed_oss": LlamaForCausalLM,
    "exaone4": OlmoForCausalLM,
    "apertus": ApertusForCausalLM,
    "cohere": CohereForCausalLM,
    "cohere2": CohereForCausalLM,
    # Llama 4: chunked local attention, NoPE layers, input-scaled MoE (models/llama4.py); the text model
    # of either checkpoint (llama4: a ConditionalGeneration checkpoint; with its vision_config the
    # tower too, models/llama4_vl.py, model_class_for)
    "llama4": Llama4ForCausalLM,
    "llama4_text": Llama4ForCausalLM,
    # Multi-head latent attention (models/deepseek.py)
    "deepseek_v2": DeepseekForCausalLM,
    "deepseek_v3": DeepseekForCausalLM,
    "glm4_moe_lite": DeepseekForCausalLM,
    "qwen2_vl": QwenVLForConditionalGeneration,
    "qwen2_5_vl": QwenVLForConditionalGeneration,
    "qwen3_vl": QwenVLForConditionalGeneration,
    "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration,
    "glm4v": Glm4vForConditionalGeneration,  # GLM-4's decoder, M-RoPE, GLM-4.1V's tower
    "glm4v_moe": Glm4vMoeForConditionalGeneration,  # GLM-4.5's decoder, M-RoPE, the same tower
    # InternViT + a Qwen2 / Qwen3 / Llama decoder (models/internvl.py)
    "internvl": InternVLForConditionalGeneration,
    # SigLIP + a pixel-shuffle connector + a Llama decoder (models/smolvlm.py)
    "idefics3": Idefics3ForConditionalGeneration,
    "smolvlm": Idefics3ForConditionalGeneration,
    # Hybrid linear attention (models/qwen3_next.py)
    "qwen3_5": Qwen3NextForCausalLM,
    "qwen3_5_moe": Qwen3NextForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    # Mamba2 + attention hybrids (models/granite_hybrid.py), on the same state cache
    "granitemoehybrid": GraniteMoeHybridForCausalLM,
    "nemotron_h": NemotronHForCausalLM,
    # attention and a Mamba2 mixer side by side in every layer (models/falcon_h1.py)
    "falcon_h1": FalconH1ForCausalLM,
    # LFM2: gated short convs + attention (models/lfm2.py), on the same state cache (conv states only)
    "lfm2": Lfm2ForCausalLM,
    "lfm2_moe": Lfm2ForCausalLM,
}
# HF `architectures` entry -> family
_HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Ernie4_5ForCausalLM": "ernie4_5",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "OlmoeForCausalLM": "olmoe",
    "HunYuanDenseV1ForCausalLM": "hunyuan_v1_dense",
    "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe",
    "GptOssForCausalLM": "gpt_oss",
    # Checkpoints of the bare decoder (sentence-transformers saves Qwen3-Embedding this way).
    "Qwen3Model": "qwen3",
    "BertModel": "bert",
    "XLMRobertaModel": "xlm-roberta",
    # Sequence classifiers and cross-encoders (ModelArch.num_labels): the family's model and a head.
    "BertForSequenceClassification": "bert",
    "XLMRobertaForSequenceClassification": "xlm-roberta",
    "ModernBertModel": "modernbert",
    "ModernBertForSequenceClassification": "modernbert",
    "NomicBertModel": "nomic_bert",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    "LlamaForSequenceClassification": "llama",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    # EmbeddingGemma (use_bidirectional_attention: an encoder, models/gemma_encoder.py).
    "Gemma3TextModel": "gemma3",
    # With its vision_config: the SigLIP tower too (models/gemma_vl.py, model_class_for).
    "Gemma3ForConditionalGeneration": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
    "MistralForCausalLM": "mistral",
    "Ministral3ForCausalLM": "ministral3",
    # With its vision_config: the Pixtral tower too (models/mistral3_vl.py, model_class_for).
    "Mistral3ForConditionalGeneration": "mistral3",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "Glm4ForCausalLM": "glm4",
    "Glm4MoeForCausalLM": "glm4_moe",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "SeedOssForCausalLM": "seed_oss",
    "Exaone4ForCausalLM": "exaone4",
    "ApertusForCausalLM": "apertus",
    "CohereForCausalLM": "cohere",
    "Cohere2ForCausalLM": "cohere2",
    "Llama4ForCausalLM": "llama4_text",
    "Llama4ForConditionalGeneration": "llama4",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
    "Glm4vForConditionalGeneration": "glm4v",
    "Glm4vMoeForConditionalGeneration": "glm4v_moe",
    "InternVLForConditionalGeneration": "internvl",
    "Idefics3ForConditionalGeneration": "idefics3",
    "SmolVLMForConditionalGeneration": "smolvlm",
    # Hybrid linear attention; the ConditionalGeneration checkpoints take images (model_class_for).
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "NemotronHForCausalLM": "nemotron_h",
    "FalconH1ForCausalLM": "falcon_h1",
    "Lfm2ForCausalLM": "lfm2",
    "Lfm2MoeForCausalLM": "lfm2_moe",
}
# Families whose checkpoints with a vision_config (arch.vision set) use another class: the decoder with
# a vision tower and M-RoPE.
_WITH_IMAGES: dict[str, type[nn.Module]] = {
    "qwen3_5": Qwen3_5ForConditionalGeneration,
    "qwen3_5_moe": Qwen3_5ForConditionalGeneration,
}
_GEMMA = ("gemma2", "gemma3", "gemma4")  # config readers in models/gemma_config.py
# Vision-language families: their text config is a Qwen2 / Qwen3 decoder's (the flags of that family).
_VL_TEXT_FAMILY = {
    "qwen2_vl": "qwen2",
    "qwen2_5_vl": "qwen2",
    "qwen3_vl": "qwen3",
    "qwen3_vl_moe": "qwen3_moe",
}
_INTERNVL_TEXT = ("qwen2", "qwen3", "qwen3_moe", "llama")  # InternVL's decoders (text_config.model_type)
_ENCODERS = ("bert", "xlm-roberta")


def supported_architectures() -> list[str]:
    return sorted(_HF_ARCHITECTURES)


def _unsupported(name: str) -> ModelLoadError:
    return ModelLoadError(
        f"unsupported model architecture {name!r}; supported: {', '.join(supported_architectures())} "
        f"(model_type {', '.join(sorted(_FAMILIES))}). overnight implements each architecture itself and "
        "never runs a checkpoint's own code, so trust_remote_code does not change this"
    )


def family_of(name: str) -> str:
    """'Qwen3ForCausalLM' or 'qwen3' -> 'qwen3'."""
    if name in _FAMILIES:
        return name
    if name in _HF_ARCHITECTURES:
        return _HF_ARCHITECTURES[name]
    raise _unsupported(name)


def get_model_class(name: str) -> type[nn.Module]:
    """The implementation for a HF architecture name or a model_type / ModelArch.architecture."""
    return _FAMILIES[family_of(name)]


def model_class_for(arch: ModelArch) -> type[nn.Module]:
    """The implementation of a ModelArch: its family's class, or the family's image model when the arch
    has a vision tower (Qwen3.5's ConditionalGeneration checkpoints, Gemma 3's, Mistral 3's)."""
    if arch.vision is not None and arch.vision.kind == "gemma3":
        return Gemma3ForConditionalGeneration
    if arch.vision is not None and arch.vision.kind == "pixtral":
        return Mistral3VLForConditionalGeneration
    if arch.vision is not None and arch.vision.kind == "llama4":
        return Llama4ForConditionalGeneration
    if arch.vision is not None and arch.vision.kind == "internvl" and arch.num_experts:
        return InternVLMoeForConditionalGeneration
    if arch.vision is not None and arch.architecture in _WITH_IMAGES:
        return _WITH_IMAGES[arch.architecture]
    if arch.is_encoder and arch.architecture == "modernbert":
        return ModernBertForSequenceClassification if arch.num_labels else ModernBertModel
    if arch.is_encoder and arch.architecture == "gemma3":
        return GemmaEncoderModel
    if arch.is_encoder and arch.num_labels:
        return BertForSequenceClassification
    return get_model_class(arch.architecture)  # a decoder classifier's head: models/for_pooling.py


def hf_architecture_of(cfg: dict[str, Any]) -> str:
    """The config's `architectures[0]`, or the one implied by its model_type."""
    archs = cfg.get("architectures") or []
    if archs:
        return archs[0]
    model_type = cfg.get("model_type")
    if model_type in _FAMILIES:
        return next(a for a, f in _HF_ARCHITECTURES.items() if f == model_type)
    raise _unsupported(str(model_type))


def is_sequence_classifier(hf_architecture: str) -> bool:
    return hf_architecture.endswith("ForSequenceClassification")


def num_labels_of(cfg: dict[str, Any]) -> int:
    """A ...ForSequenceClassification config's label count (transformers: id2label, else num_labels,
    else 2); 0 for any other architecture."""
    if not is_sequence_classifier(hf_architecture_of(cfg)):
        return 0
    id2label = cfg.get("id2label")
    n = len(id2label) if isinstance(id2label, dict) and id2label else int(cfg.get("num_labels", 2))
    if n < 1:
        raise ModelLoadError(f"a sequence classifier needs at least one label, config.json has {n}")
    return n


def _bert_arch(cfg: dict[str, Any], family: str) -> ModelArch:
    if cfg.get("hidden_act", "gelu") != "gelu":
        raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r} for BERT (only gelu)")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(
            f"unsupported position_embedding_type {cfg['position_embedding_type']!r} (only absolute)"
        )
    heads = cfg["num_attention_heads"]
    # RoBERTa numbers positions from pad_token_id + 1: the table's first rows are never used.
    offset = int(cfg.get("pad_token_id", 1)) + 1 if family == "xlm-roberta" else 0
    table = cfg.get("max_position_embeddings", 512)
    if table <= offset:
        raise ModelLoadError(f"max_position_embeddings ({table}) leaves no positions past the padding id")
    return ModelArch(
        architecture=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=cfg["hidden_size"] // heads,
        max_position_embeddings=table - offset,
        is_encoder=True,
        type_vocab_size=cfg.get("type_vocab_size", 2),
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        position_offset=offset,
        num_labels=num_labels_of(cfg),
    )


def arch_from_hf_config(cfg: dict[str, Any]) -> ModelArch:
    """Read a config.json dict; raises ModelLoadError for architectures or features not implemented."""
    family = family_of(hf_architecture_of(cfg))
    if family in _GEMMA:
        return gemma_arch(cfg, family, hf_architecture_of(cfg))
    if family == "modernbert":
        return modernbert_arch(cfg, num_labels_of(cfg))
    if family == "nomic_bert":
        return nomic_arch(cfg)
    if family in _ENCODERS:
        try:
            return _bert_arch(cfg, family)
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
    if family in HYBRID_FAMILIES:
        arch = hybrid_arch(cfg, family)
        # A ConditionalGeneration checkpoint without vision_config (the dummy presets) runs as the
        # text model.
        conditional = hf_architecture_of(cfg).endswith("ForConditionalGeneration")
        if family in _WITH_IMAGES and conditional and isinstance(cfg.get("vision_config"), dict):
            return with_vision(cfg, arch)
        return arch
    if family == "granitemoehybrid":
        return granite_hybrid_arch(cfg)
    if family == "nemotron_h":
        return nemotron_h_arch(cfg)
    if family == "falcon_h1":
        return falcon_h1_arch(cfg)
    if family in ("lfm2", "lfm2_moe"):
        return lfm2_arch(cfg, moe=family == "lfm2_moe")
    if family == "gpt_oss":
        return _gpt_oss_arch(cfg)
    if family in ("llama4", "llama4_text"):
        return llama4_arch(cfg)
    if family in _VL_TEXT_FAMILY:
        return _vision_language_arch(cfg, family)
    if family in ("glm4v", "glm4v_moe"):
        return _glm4v_arch(cfg, family)
    if family == "internvl":
        return _internvl_arch(cfg)
    if family in ("idefics3", "smolvlm"):
        return idefics3_arch(cfg, family, arch_from_hf_config)
    if family in TEXT_CONFIG_FAMILIES:  # Mistral 3: its text model's config, and with vision_config the tower
        arch = _decoder_arch(text_config(cfg), family)
        if not isinstance(cfg.get("vision_config"), dict):
            return arch
        return replace(arch, vision=mistral3_vision_arch(cfg, arch.hidden_size, arch.rms_norm_eps))
    return _decoder_arch(cfg, family)


def _decoder_arch(cfg: dict[str, Any], family: str) -> ModelArch:
    """The dense decoder families' ModelArch (Llama's blocks and the families' flags)."""
    if cfg.get("hidden_act", "silu") != "silu" and family != "apertus":  # Apertus': its own reader
        raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
    if cfg.get("mlp_bias"):
        raise ModelLoadError("unsupported: mlp_bias=true")
    windows = _window_fields(cfg, family)
    if cfg.get("use_sliding_window") and family not in (*WINDOWED_FAMILIES, "qwen2", "qwen3"):
        raise ModelLoadError("unsupported: use_sliding_window=true (sliding-window attention)")
    theta, scaling = rope_params(cfg)
    try:
        heads = cfg["num_attention_heads"]
        fields: dict[str, Any] = dict(
            architecture=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has a q/k/v bias and none on o_proj; the others say so in attention_bias,
            # which covers both.
            attention_bias=True if family == "qwen2" else bool(cfg.get("attention_bias", False)),
            o_proj_bias=False if family == "qwen2" else bool(cfg.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            **windows,
        )
        fields["num_labels"] = num_labels_of(cfg)  # a ...ForSequenceClassification (models/for_pooling.py)
        if family == "qwen3_moe":
            fields.update(_moe_fields(cfg))
        if family == "qwen2_moe":
            fields.update(_moe_fields(cfg))
        fields.update(family_fields(family, cfg))
        return checked_rope(ModelArch(**fields))
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None


def _window_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """ModelArch's per-layer kinds of a Qwen2 / Qwen3 config with use_sliding_window (HF's rule: the
    window applies only then; layer_types, else every layer from max_window_layers on is windowed)."""
    if not cfg.get("use_sliding_window"):
        return {}
    if family not in ("qwen2", "qwen3"):
        return {}  # the families that read windows their own way (models/hf_config.py), or refuse them
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"use_sliding_window=true needs a positive sliding_window, got {window!r}")
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", n)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    kinds = ("full_attention", "sliding_attention")
    if len(types) != n or any(t not in kinds for t in types):
        raise ModelLoadError(f"layer_types must name {n} layers, each one of {', '.join(kinds)}")
    return dict(layer_types=tuple(types), sliding_window=window)


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelArch's mixture-of-experts fields from a Qwen3-MoE config (transformers 5 writes the expert
    count as num_local_experts, the published checkpoints as num_experts)."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        raise ModelLoadError("config.json lacks required field 'num_experts'")
    try:
        top_k = int(cfg["num_experts_per_tok"])
        inter = int(cfg["moe_intermediate_size"])
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
    step = int(cfg.get("decoder_sparse_step", 1))
    if not 0 < top_k <= experts:
        raise ModelLoadError(f"num_experts_per_tok must be in 1..num_experts ({experts}), got {top_k}")
    if inter <= 0 or step <= 0:
        raise ModelLoadError("moe_intermediate_size and decoder_sparse_step must be positive")
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(sorted(int(i) for i in cfg.get("mlp_only_layers") or ())),
    )


def _gpt_oss_arch(cfg: dict[str, Any]) -> ModelArch:
    """gpt-oss: every layer sparse, biases everywhere, sinks, alternating windows (models/gpt_oss.py)."""
    qc = cfg.get("quantization_config") or {}
    if qc and qc.get("quant_method") != "mxfp4":
        raise ModelLoadError(
            f"gpt-oss with quantization method {qc.get('quant_method')!r} is not supported "
            "(the published MXFP4 checkpoints and unquantized ones are)"
        )
    theta, scaling = rope_params(cfg)
    try:
        layers = int(cfg["num_hidden_layers"])
        layer_types = tuple(
            cfg.get("layer_types")
            or ("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
        )
        experts = int(cfg.get("num_local_experts") or cfg["num_experts"])
        heads = int(cfg["num_attention_heads"])
        return ModelArch(
            architecture="gpt_oss",
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 131072),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", True)),
            o_proj_bias=bool(cfg.get("attention_bias", True)),
            layer_types=layer_types,
            sliding_window=cfg.get("sliding_window"),
            num_experts=experts,
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=cfg["intermediate_size"],
            norm_topk_prob=True,  # softmax over the k chosen logits
            attention_sinks=True,
            expert_bias=True,
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            experts_mxfp4=qc.get("quant_method") == "mxfp4",
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None


def _vision_language_arch(cfg: dict[str, Any], family: str) -> ModelArch:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: the decoder from text_config (as its Qwen2 / Qwen3 family reads
    it), with M-RoPE's sections and the vision tower (models/vision/config.py)."""
    text = text_config_of(cfg)
    text_family = _VL_TEXT_FAMILY[family]
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
    plain = {**text, "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_scaling": None}
    if family == "qwen3_vl_moe":
        plain["norm_topk_prob"] = True  # its router always renormalizes the chosen experts' weights
    base = arch_from_hf_config({**plain, "architectures": [], "model_type": text_family})
    section = tuple(int(s) for s in params.get("mrope_section") or ())
    if len(section) != 3 or 2 * sum(section) != base.head_dim:
        raise ModelLoadError(
            f"rope_parameters.mrope_section must be three sizes summing to head_dim / 2 ({base.head_dim // 2}), "
            f"got {list(section)}"
        )
    return replace(
        base,
        architecture=family,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        mrope_section=section,
        # Qwen2-VL and Qwen2.5-VL give each axis a contiguous run of frequencies; Qwen3-VL interleaves them.
        mrope_interleaved=bool(params.get("mrope_interleaved", family not in ("qwen2_vl", "qwen2_5_vl"))),
        vision=vision_arch_from_hf(cfg, "qwen3_vl" if family == "qwen3_vl_moe" else family),
    )


def _glm4v_arch(cfg: dict[str, Any], family: str) -> ModelArch:
    """GLM-4.1V (glm4v) and GLM-4.5V / 4.6V (glm4v_moe): text_config is GLM-4's decoder (read as the glm4
    family: sandwich norms, partial RoPE in interleaved pairs; q / k / v biases whatever attention_bias
    says, as transformers' Glm4vText attention always has them) or GLM-4.5's (glm4_moe: rotate-half
    partial RoPE, routed and shared experts, the grouped sigmoid router), with partial_rotary_factor as
    transformers reads it for each (unset: 1 for GLM-4.1V, 0.5 for GLM-4.5V; the published configs say
    0.5) and M-RoPE's sections over the rotated dims' frequencies; the tower from vision_config
    (models/vision/config.py)."""
    moe = family == "glm4v_moe"
    text = text_config_of(cfg)
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
    factor = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.5 if moe else 1.0))
    plain = {
        **text,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_scaling": None,
        "partial_rotary_factor": factor,
        "attention_bias": bool(text.get("attention_bias", True)) if moe else True,
    }
    if params.get("rope_type", params.get("type", "default")) != "default":
        raise ModelLoadError(f"unsupported GLM-V rope_type {params.get('rope_type')!r} (only default)")
    base = arch_from_hf_config({**plain, "architectures": [], "model_type": "glm4_moe" if moe else "glm4"})
    section = tuple(int(s) for s in params.get("mrope_section") or ())
    if len(section) != 3 or 2 * sum(section) != base.rotary_dim:
        raise ModelLoadError(
            "rope_parameters.mrope_section must be three sizes summing to the rotated dims / 2 "
            f"({base.rotary_dim // 2}: head_dim {base.head_dim} x partial_rotary_factor {factor} / 2), "
            f"got {list(section)}"
        )
    return replace(
        base,
        architecture=family,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        mrope_section=section,
        mrope_interleaved=False,
        vision=glm4v_vision_arch(cfg, base.hidden_size),
    )


def _internvl_arch(cfg: dict[str, Any]) -> ModelArch:
    """InternVL: its text_config's decoder (as that family reads it) and the InternViT tower. The LM head
    is tied when the top level says so, else as the text model says (the published InternVL 3.5
    configs leave the top level unset while their checkpoints hold an lm_head of their own, which
    transformers then keeps untied)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError("config.json lacks required field 'text_config'")
    text_family = text.get("model_type", "qwen2")
    if text_family not in _INTERNVL_TEXT:
        raise ModelLoadError(
            f"unsupported text model {text_family!r} in an InternVL checkpoint ({', '.join(_INTERNVL_TEXT)})"
        )
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    base = arch_from_hf_config({**text, "architectures": [], "model_type": text_family})
    return replace(
        base,
        architecture="internvl",
        tie_word_embeddings=bool(tie),
        vision=internvl_vision_arch(cfg, base.hidden_size),
    )
