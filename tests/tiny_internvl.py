"""A tiny random InternVL checkpoint (InternViT of 2 layers on 24-pixel tiles of 4-pixel patches, pixel
shuffle 2 x 2: 9 tokens a tile, 1 to 4 tiles plus a thumbnail; a 2-layer Qwen3 decoder) and a
word-level tokenizer holding InternVL's image tokens, with a chat template that writes each image part
as <IMG_CONTEXT>; plus transformers' own InternVLProcessor and greedy generate as the reference."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.tiny_vl import ProcessorReference, save_word_tokenizer

SPECIALS = [
    "<unk>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<video>",
]
VOCAB = 256
TOKENS = SPECIALS + [f"w{i}" for i in range(len(SPECIALS), VOCAB)]
IDS = {t: i for i, t in enumerate(TOKENS)}
WORDS = TOKENS[len(SPECIALS) :]
PATCH, TILE, MAX_TILES = 4, 24, 4
PER_TILE = (TILE // PATCH // 2) ** 2  # 9
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<IMG_CONTEXT> "
    "{% elif p['type'] == 'text' %}{{ p['text'] }} {% endif %}{% endfor %}{% endif %}<|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> w9 {% endif %}"
)


def make_internvl_checkpoint(
    root: str | os.PathLike,
    seed: int = 0,
    vision: dict[str, Any] | None = None,
    text: dict[str, Any] | None = None,
    tile: int = TILE,
    **changes: Any,
) -> str:
    """The checkpoint folder; `vision` / `text` override vision_config / text_config fields, `changes`
    the top level's; `tile` is the image processor's tile side (the tower's image_size stays TILE)."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from tests.tiny_models import _spread_weights

    folder = os.path.join(str(root), f"internvl_{seed}")
    cfg = InternVLConfig(
        text_config={
            "model_type": "qwen3",
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            **(text or {}),
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": TILE,
            "patch_size": PATCH,
            "attention_bias": True,  # InternViT-300M's (the 6B has none)
            **(vision or {}),
        },
        image_token_id=IDS["<IMG_CONTEXT>"],
        image_seq_length=(tile // PATCH // 2) ** 2,
        tie_word_embeddings=False,
        **changes,
    )
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        _spread_weights(model, seed)
        for name, p in model.named_parameters():  # norms and layer scales near 1, as trained ones are
            if name.endswith(("layernorm_before.weight", "layernorm_after.weight", "layer_norm.weight")):
                p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
            elif name.endswith(("lambda_1", "lambda_2", "layernorm.weight")):
                p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
    model.config.eos_token_id = IDS["<|im_end|>"]
    model.config.bos_token_id = IDS["<|endoftext|>"]
    model.save_pretrained(folder)

    save_word_tokenizer(
        folder,
        IDS,
        SPECIALS,
        CHAT_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "context_image_token": "<IMG_CONTEXT>",
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "video_token": "<video>",
        },
    )
    GotOcr2ImageProcessorPil(
        size={"height": tile, "width": tile},
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
        min_patches=1,
        max_patches=MAX_TILES,
    ).save_pretrained(folder)
    return folder


def _no_video_processor() -> Any:
    """A stand-in for InternVLVideoProcessor (its module needs torchvision): the processor requires one
    but these prompts hold no video."""
    import transformers

    cls = transformers.BaseVideoProcessor  # (without torchvision, the class the processor checks for)
    return cls.__new__(cls)


def hf_reference(folder: str, per_tile: int = PER_TILE) -> ProcessorReference:
    """transformers' InternVLProcessor (its PIL image processor) and greedy generate."""
    from transformers import AutoTokenizer
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    processor = InternVLProcessor(
        image_processor=GotOcr2ImageProcessorPil.from_pretrained(folder),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        video_processor=_no_video_processor(),
        image_seq_length=per_tile,
    )
    return ProcessorReference(folder, processor)
