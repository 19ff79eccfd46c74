"""VisionArch from a vision-language config.json (HF's vision_config and the image token ids)."""

from __future__ import annotations

from typing import Any

from overnight.arch import VisionArch
from overnight.errors import ModelLoadError


def text_config_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's fields: text_config (transformers 5), or the top level (older Qwen2.5-VL files)."""
    return dict(cfg.get("text_config") or cfg)


def vision_arch_from_hf(cfg: dict[str, Any], kind: str) -> VisionArch:
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ModelLoadError("config.json lacks vision_config")
    image_token = cfg.get("image_token_id", cfg.get("image_token_index"))
    if not isinstance(image_token, int):
        raise ModelLoadError("config.json lacks image_token_id")
    try:
        if kind == "qwen2_vl":
            # Qwen2-VL names the tower's width embed_dim, its MLP's mlp_ratio x that, and the merger's
            # output width (the decoder's) hidden_size.
            hidden = int(v.get("embed_dim", 1280))
            inter = int(hidden * float(v.get("mlp_ratio", 4)))
            out = int(v.get("hidden_size") or text_config_of(cfg)["hidden_size"])
            act = str(v.get("hidden_act", "quick_gelu"))
        else:
            hidden = int(v.get("hidden_size") or v["embed_dim"])
            inter = int(v["intermediate_size"])
            out = int(v.get("out_hidden_size") or text_config_of(cfg)["hidden_size"] or 0)
            act = str(v.get("hidden_act", "silu"))
        theta = float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        windowed = kind == "qwen2_5_vl"  # Qwen2-VL has no windows whatever its file says
        arch = VisionArch(
            kind=kind,
            depth=int(v["depth"]),
            hidden_size=hidden,
            intermediate_size=inter,
            num_heads=int(v["num_heads"]),
            out_hidden_size=out,
            patch_size=int(v.get("patch_size", 14)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            in_channels=int(v.get("in_channels") or v.get("in_chans") or 3),
            hidden_act=act,
            image_token_id=image_token,
            vision_start_token_id=cfg.get("vision_start_token_id"),
            vision_end_token_id=cfg.get("vision_end_token_id"),
            rope_theta=theta,
            window_size=int(v.get("window_size", 0)) if windowed else 0,
            fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes") or ())
            if windowed
            else (),
            num_position_embeddings=int(v.get("num_position_embeddings", 0)),
            deepstack_visual_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes") or ()),
        )
    except KeyError as e:
        raise ModelLoadError(f"vision_config lacks required field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"invalid {kind} vision_config: {e}") from None
    if kind == "qwen2_vl" and (arch.intermediate_size <= 0 or arch.out_hidden_size <= 0):
        raise ModelLoadError("Qwen2-VL's vision_config needs a positive embed_dim, mlp_ratio and hidden_size")
    if kind == "qwen2_vl" and arch.hidden_act not in ("quick_gelu", "gelu", "gelu_pytorch_tanh", "silu"):
        raise ModelLoadError(f"unsupported Qwen2-VL vision hidden_act {arch.hidden_act!r}")
    if arch.hidden_size % arch.num_heads or (arch.hidden_size // arch.num_heads) % 4:
        raise ModelLoadError("vision hidden_size / num_heads must be a multiple of 4 (2-D RoPE)")
    if kind == "qwen2_5_vl" and arch.window_size < arch.patch_size * arch.spatial_merge_size:
        raise ModelLoadError("vision_config.window_size must cover at least one merged patch")
    if kind == "qwen3_vl" and int(arch.num_position_embeddings**0.5) ** 2 != arch.num_position_embeddings:
        raise ModelLoadError("vision_config.num_position_embeddings must be a square")
    return arch


def glm4v_vision_arch(cfg: dict[str, Any], text_hidden: int) -> VisionArch:
    """GLM-4.1V's tower (models/vision/glm4v_vit.py) and its image tokens: <|begin_of_image|>, the
    image's <|image|> tokens (image_token_id, one per merged patch), <|end_of_image|>. image_size /
    patch_size is the side of the learned position table; rms_norm_eps its RMSNorms'; attention_bias
    the qkv bias; out_hidden_size (the downsample conv's and the merger's width) must be the text
    model's hidden size."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ModelLoadError("config.json lacks vision_config")
    params: dict[str, Any] = v.get("rope_parameters") or {}
    try:
        arch = VisionArch(
            kind="glm4v",
            depth=int(v.get("depth", 24)),
            hidden_size=int(v.get("hidden_size", 1536)),
            intermediate_size=int(v.get("intermediate_size", 13696)),
            num_heads=int(v.get("num_heads", 12)),
            out_hidden_size=int(v.get("out_hidden_size", 4096)),
            patch_size=int(v.get("patch_size", 14)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            in_channels=int(v.get("in_channels", 3)),
            hidden_act=str(v.get("hidden_act", "silu")),
            image_token_id=int(cfg.get("image_token_id", 151343)),
            vision_start_token_id=int(cfg.get("image_start_token_id", 151339)),
            vision_end_token_id=int(cfg.get("image_end_token_id", 151340)),
            rope_theta=float(params.get("rope_theta") or v.get("rope_theta") or 10000.0),
            image_size=int(v.get("image_size", 336)),
            layer_norm_eps=float(v.get("rms_norm_eps", 1e-5)),
            attention_bias=bool(v.get("attention_bias", False)),
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"invalid GLM-4.1V vision_config: {e}") from None
    if arch.hidden_size % arch.num_heads or (arch.hidden_size // arch.num_heads) % 4:
        raise ModelLoadError("GLM-4.1V's vision hidden_size / num_heads must be a multiple of 4 (2-D RoPE)")
    if arch.image_size < arch.patch_size or arch.image_size % arch.patch_size:
        raise ModelLoadError(
            f"GLM-4.1V's vision image_size {arch.image_size} must be whole patches ({arch.patch_size}): "
            "the position table's side"
        )
    if arch.out_hidden_size != text_hidden:
        raise ModelLoadError(
            f"GLM-4.1V's vision out_hidden_size ({arch.out_hidden_size}) must equal the text model's "
            f"hidden_size ({text_hidden})"
        )
    if params.get("rope_type", "axial") != "axial":
        raise ModelLoadError(f"unsupported GLM-4.1V vision rope_type {params['rope_type']!r} (only axial)")
    if arch.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh"):
        raise ModelLoadError(f"unsupported GLM-4.1V vision hidden_act {arch.hidden_act!r}")
    return arch


def gemma3_vision_arch(cfg: dict[str, Any], text_hidden: int) -> VisionArch:
    """Gemma 3's SigLIP tower (vision_config) and its image tokens: boi, mm_tokens_per_image soft tokens,
    eoi. spatial_merge_size is the projector's pooling kernel (patches per side / tokens per side), so
    VisionArch.num_tokens of the patch grid is mm_tokens_per_image as for the Qwen towers. On sliding
    layers an image token sees its window back from its own position and its image's later tokens (as
    transformers masks it), so an image may be longer than the window."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ModelLoadError("config.json lacks vision_config")
    image_token = cfg.get("image_token_id", cfg.get("image_token_index", 262_144))
    boi = cfg.get("boi_token_id", cfg.get("boi_token_index", 255_999))
    eoi = cfg.get("eoi_token_id", cfg.get("eoi_token_index", 256_000))
    tokens = int(cfg.get("mm_tokens_per_image") or 256)
    try:
        image_size, patch = int(v.get("image_size", 224)), int(v.get("patch_size", 16))
        per_side, tokens_side = image_size // patch, int(round(tokens**0.5))
        if tokens_side**2 != tokens or per_side % tokens_side:
            raise ModelLoadError(
                f"mm_tokens_per_image ({tokens}) must be a square whose side divides the {per_side} patches "
                f"per side of image_size {image_size} / patch_size {patch}"
            )
        arch = VisionArch(
            kind="gemma3",
            depth=int(v.get("num_hidden_layers", 12)),
            hidden_size=int(v.get("hidden_size", 768)),
            intermediate_size=int(v.get("intermediate_size", 3072)),
            num_heads=int(v.get("num_attention_heads", 12)),
            out_hidden_size=text_hidden,
            patch_size=patch,
            temporal_patch_size=1,
            spatial_merge_size=per_side // tokens_side,
            in_channels=int(v.get("num_channels", 3)),
            hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
            image_token_id=int(image_token),
            vision_start_token_id=int(boi),
            vision_end_token_id=int(eoi),
            image_size=image_size,
            mm_tokens_per_image=tokens,
            layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"invalid Gemma 3 vision_config: {e}") from None
    if arch.hidden_act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"unsupported SigLIP hidden_act {arch.hidden_act!r} (gelu_pytorch_tanh)")
    if arch.hidden_size % arch.num_heads:
        raise ModelLoadError("vision_config.hidden_size must be a multiple of num_attention_heads")
    return arch


def mistral3_vision_arch(cfg: dict[str, Any], text_hidden: int, text_eps: float) -> VisionArch:
    """Mistral 3's Pixtral tower (vision_config) and projector (the top level's spatial_merge_size,
    projector_hidden_act, vision_feature_layer, multimodal_projector_bias; its RMSNorm takes the text
    model's rms_norm_eps, as transformers builds it). The [IMG_BREAK] / [IMG_END] ids are the
    tokenizer's (multimodal/pixtral_prompt.py): config.json names only [IMG]."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ModelLoadError("config.json lacks vision_config")
    image_token = cfg.get("image_token_index", cfg.get("image_token_id", 10))
    layers = cfg.get("vision_feature_layer", -1)
    params: dict[str, Any] = v.get("rope_parameters") or {}
    theta = params.get("rope_theta") or v.get("rope_theta") or 10000.0
    try:
        hidden, heads = int(v.get("hidden_size", 1024)), int(v.get("num_attention_heads", 16))
        depth = int(v.get("num_hidden_layers", 24))
        arch = VisionArch(
            kind="pixtral",
            depth=depth,
            hidden_size=hidden,
            intermediate_size=int(v.get("intermediate_size", 4096)),
            num_heads=heads,
            out_hidden_size=text_hidden,
            patch_size=int(v.get("patch_size", 16)),
            temporal_patch_size=1,
            spatial_merge_size=int(cfg.get("spatial_merge_size", 2)),
            in_channels=int(v.get("num_channels", 3)),
            hidden_act=str(v.get("hidden_act", "gelu")),
            image_token_id=int(image_token),
            rope_theta=float(theta),
            image_size=int(v.get("image_size", 1024)),
            layer_norm_eps=float(text_eps),
            vision_feature_layer=layers if isinstance(layers, int) else depth + 1,  # refused below
            projector_hidden_act=str(cfg.get("projector_hidden_act", "gelu")),
            projector_bias=bool(cfg.get("multimodal_projector_bias", False)),
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"invalid Mistral 3 vision_config: {e}") from None
    head_dim = v.get("head_dim")
    if hidden % heads or (hidden // heads) % 4 or (head_dim is not None and head_dim != hidden // heads):
        raise ModelLoadError(
            "Pixtral's vision_config needs hidden_size / num_attention_heads (= head_dim) divisible by 4 "
            f"(2-D RoPE), got hidden_size {hidden}, {heads} heads, head_dim {head_dim}"
        )
    if params.get("rope_type", "axial") != "axial":
        raise ModelLoadError(f"unsupported Pixtral rope_type {params['rope_type']!r} (only axial)")
    if not -depth - 1 <= arch.vision_feature_layer <= depth:
        raise ModelLoadError(
            f"vision_feature_layer must be one hidden state of the tower (-{depth + 1}..{depth}), "
            f"got {layers!r}"
        )
    acts = (
        ("vision_config.hidden_act", arch.hidden_act),
        ("projector_hidden_act", arch.projector_hidden_act),
    )
    for name, act in acts:
        if act not in ("gelu", "silu", "gelu_pytorch_tanh"):
            raise ModelLoadError(f"unsupported {name} {act!r} (gelu, silu or gelu_pytorch_tanh)")
    if arch.spatial_merge_size < 1:
        raise ModelLoadError("spatial_merge_size must be at least 1")
    return arch


def _side(value: Any, name: str) -> int:
    """An InternViT size (an int, or [height, width] of equal sides)."""
    sides = value if isinstance(value, (list, tuple)) else (value, value)
    if len(sides) != 2 or int(sides[0]) != int(sides[1]):
        raise ModelLoadError(f"InternVL vision_config.{name} must be square, got {value!r}")
    return int(sides[0])


def _check_pixel_shuffle(
    family: str, ratio_name: str, ratio: float, merge: int, image_size: int, patch: int
) -> None:
    """InternVL's and Llama 4's pixel shuffle: `merge` x `merge` patches into one token (ratio 1 / merge)
    over square tiles of whole patches, their count per side a multiple of merge."""
    if merge < 1 or abs(merge * ratio - 1) > 1e-6:
        raise ModelLoadError(f"{ratio_name} must be 1 / n for a whole n (0.5: 2 x 2), got {ratio}")
    side = image_size // patch
    if image_size % patch or side % merge:
        raise ModelLoadError(
            f"{family}'s image_size {image_size} must be whole patches ({patch}) whose count per side ({side}) "
            f"divides by 1 / {ratio_name} ({merge})"
        )


def internvl_vision_arch(cfg: dict[str, Any], text_hidden: int) -> VisionArch:
    """InternVL's InternViT tower (vision_config) and projector (the top level's downsample_ratio,
    projector_hidden_act, vision_feature_layer). <img> / </img> are the tokenizer's
    (multimodal/internvl_prompt.py): config.json names only <IMG_CONTEXT> (image_token_id)."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ModelLoadError("config.json lacks vision_config")
    layers = cfg.get("vision_feature_layer", -1)
    ratio = float(cfg.get("downsample_ratio", 0.5))
    try:
        depth = int(v.get("num_hidden_layers", 24))
        image_size, patch = (
            _side(v.get("image_size", 448), "image_size"),
            _side(v.get("patch_size", 14), "patch_size"),
        )
        merge = round(1 / ratio) if ratio > 0 else 0
        arch = VisionArch(
            kind="internvl",
            depth=depth,
            hidden_size=int(v.get("hidden_size", 1024)),
            intermediate_size=int(v.get("intermediate_size", 4096)),
            num_heads=int(v.get("num_attention_heads", 16)),
            out_hidden_size=text_hidden,
            patch_size=patch,
            temporal_patch_size=1,
            spatial_merge_size=merge,
            in_channels=int(v.get("num_channels", 3)),
            hidden_act=str(v.get("hidden_act", "gelu")),
            image_token_id=int(cfg.get("image_token_id", cfg.get("image_token_index", 151667))),
            image_size=image_size,
            layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
            vision_feature_layer=layers if isinstance(layers, int) else depth + 1,  # refused below
            projector_hidden_act=str(cfg.get("projector_hidden_act", "gelu")),
            norm_type=str(v.get("norm_type", "layer_norm")),
            qk_norm=bool(v.get("use_qk_norm", False)),
            attention_bias=bool(v.get("attention_bias", False)),
            final_norm=not v.get("use_mean_pooling", True),
            position_embeddings=bool(v.get("use_absolute_position_embeddings", True)),
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"invalid InternVL vision_config: {e}") from None
    _check_pixel_shuffle("InternVL", "downsample_ratio", ratio, merge, image_size, patch)
    if arch.hidden_size % arch.num_heads:
        raise ModelLoadError("vision_config.hidden_size must be a multiple of num_attention_heads")
    if arch.norm_type not in ("layer_norm", "rms_norm"):
        raise ModelLoadError(f"unsupported InternVL norm_type {arch.norm_type!r} (layer_norm or rms_norm)")
    if cfg.get("vision_feature_select_strategy", "default") != "default":
        raise ModelLoadError(
            "unsupported vision_feature_select_strategy "
            f"{cfg['vision_feature_select_strategy']!r} (only default: the CLS token dropped)"
        )
    if not -depth - 1 <= arch.vision_feature_layer <= depth:
        raise ModelLoadError(
            f"vision_feature_layer must be one hidden state of the tower (-{depth + 1}..{depth}), got {layers!r}"
        )
    for name, act in (
        ("vision_config.hidden_act", arch.hidden_act),
        ("projector_hidden_act", arch.projector_hidden_act),
    ):
        if act not in ("gelu", "silu", "gelu_pytorch_tanh"):
            raise ModelLoadError(f"unsupported {name} {act!r} (gelu, silu or gelu_pytorch_tanh)")
    return arch


def llama4_vision_arch(cfg: dict[str, Any], text_hidden: int) -> VisionArch:
    """Llama 4's ViT (vision_config), its pixel-shuffle adapter and projector. The adapter's MLP reads
    the shuffled patches at the tower's intermediate_size and keeps one width (projector_input_dim =
    projector_output_dim = vision_output_dim, as every published checkpoint has them), which is what
    transformers' modules can load. <|patch|> is image_token_index; <|image_start|> / <|image_end|> are
    boi / eoi; the tile separators and <|image|> are the tokenizer's (multimodal/llama4_prompt.py)."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ModelLoadError("config.json lacks vision_config")
    params: dict[str, Any] = v.get("rope_parameters") or {}
    ratio = float(v.get("pixel_shuffle_ratio", 0.5))
    try:
        hidden, heads = int(v.get("hidden_size", 768)), int(v.get("num_attention_heads", 16))
        image_size, patch = (
            _side(v.get("image_size", 448), "image_size"),
            _side(v.get("patch_size", 14), "patch_size"),
        )
        merge = round(1 / ratio) if ratio > 0 else 0
        widths = {k: int(v.get(k, 4096)) for k in ("projector_input_dim", "projector_output_dim")}
        widths["vision_output_dim"] = int(v.get("vision_output_dim", 7680))
        arch = VisionArch(
            kind="llama4",
            depth=int(v.get("num_hidden_layers", 34)),
            hidden_size=hidden,
            intermediate_size=int(v.get("intermediate_size", 5632)),
            num_heads=heads,
            out_hidden_size=text_hidden,
            patch_size=patch,
            temporal_patch_size=1,
            spatial_merge_size=merge,
            in_channels=int(v.get("num_channels", 3)),
            hidden_act="gelu",  # transformers' Llama 4 tower uses exact GELU whatever hidden_act says
            image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 200092))),
            vision_start_token_id=int(cfg.get("boi_token_index", cfg.get("boi_token_id", 200080))),
            vision_end_token_id=int(cfg.get("eoi_token_index", cfg.get("eoi_token_id", 200081))),
            rope_theta=float(params.get("rope_theta") or v.get("rope_theta") or 10000.0),
            image_size=image_size,
            layer_norm_eps=1e-5,  # torch's LayerNorm default, as transformers builds them
            projector_hidden_size=widths["projector_input_dim"],
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"invalid Llama 4 vision_config: {e}") from None
    _check_pixel_shuffle("Llama 4", "pixel_shuffle_ratio", ratio, merge, image_size, patch)
    if hidden % heads or (hidden // heads) % 4:
        raise ModelLoadError(
            f"Llama 4's vision hidden_size / num_attention_heads must be a multiple of 4 (2-D RoPE), got "
            f"hidden_size {hidden}, {heads} heads"
        )
    if arch.intermediate_size != hidden * merge**2:
        raise ModelLoadError(
            f"Llama 4's vision intermediate_size ({arch.intermediate_size}) must equal hidden_size x "
            f"(1 / pixel_shuffle_ratio)^2 ({hidden * merge**2}): the adapter reads the shuffled patches at it"
        )
    if len(set(widths.values())) != 1:
        raise ModelLoadError(f"Llama 4's adapter widths must be equal, got {widths}")
    if params.get("rope_type", "default") != "default":
        raise ModelLoadError(f"unsupported Llama 4 vision rope_type {params['rope_type']!r} (only default)")
    if (
        cfg.get("vision_feature_select_strategy", v.get("vision_feature_select_strategy", "default"))
        != "default"
    ):
        raise ModelLoadError(
            "unsupported vision_feature_select_strategy (only default: the class token dropped)"
        )
    return arch


def idefics3_vision_arch(cfg: dict[str, Any], text_hidden: int) -> VisionArch:
    """Idefics3 / SmolVLM's SigLIP tower (vision_config) and connector (the top level's scale_factor: a
    scale x scale pixel shuffle, then one linear). Every frame the image processor makes (the tiles and
    the global image) is image_size square, so the tower's patch grid is fixed and a frame gives
    mm_tokens_per_image = (image_size / patch / scale)^2 tokens (HF's image_seq_len). <image> is
    image_token_id; <fake_token_around_image>, <global-img> and <row_r_col_c> are the tokenizer's
    (multimodal/idefics3_prompt.py)."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ModelLoadError("config.json lacks vision_config")
    try:
        image_size, patch = int(v.get("image_size", 224)), int(v.get("patch_size", 32))
        scale = int(cfg.get("scale_factor", 2))
        arch = VisionArch(
            kind="idefics3",
            depth=int(v.get("num_hidden_layers", 12)),
            hidden_size=int(v.get("hidden_size", 1152)),
            intermediate_size=int(v.get("intermediate_size", 3072)),
            num_heads=int(v.get("num_attention_heads", 16)),
            out_hidden_size=text_hidden,
            patch_size=patch,
            temporal_patch_size=1,
            spatial_merge_size=scale,
            in_channels=int(v.get("num_channels", 3)),
            hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
            image_token_id=int(cfg.get("image_token_id", cfg.get("image_token_index", 128257))),
            image_size=image_size,
            mm_tokens_per_image=(image_size // patch // max(scale, 1)) ** 2,
            layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"invalid Idefics3 / SmolVLM vision_config: {e}") from None
    side = image_size // patch
    if scale < 1 or image_size % patch or side % scale:
        raise ModelLoadError(
            f"Idefics3 / SmolVLM's image_size {image_size} must be whole patches ({patch}) whose count per "
            f"side ({side}) divides by scale_factor ({scale})"
        )
    if arch.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
        raise ModelLoadError(f"unsupported SigLIP hidden_act {arch.hidden_act!r} (gelu_pytorch_tanh or gelu)")
    if arch.hidden_size % arch.num_heads:
        raise ModelLoadError("vision_config.hidden_size must be a multiple of num_attention_heads")
    return arch
