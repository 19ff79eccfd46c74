"""A tiny random GLM-4.1V checkpoint (Glm4vForConditionalGeneration; GLM-4.5V's with moe): a tower of 2 blocks, width 32, on
4-pixel patches with an 4 x 4 learned position table (image_size 16), merged 2 x 2 into the decoder's
width; a 2-layer GLM-4 decoder (head_dim 32, half of it rotated in interleaved pairs, M-RoPE sections
[2, 3, 3]); images resized to at most 48 x 48 pixels (36 image tokens). A word-level tokenizer holds
GLM's image tokens (<|begin_of_image|>, <|image|>, <|end_of_image|>) and a chat template that writes
each image part as <|begin_of_image|> <|image|> <|end_of_image|>; the reference is transformers' own
Glm4vProcessor (its PIL image processor) and greedy generate."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.tiny_vl import ProcessorReference, save_word_tokenizer

SPECIALS = [
    "<unk>",
    "<|endoftext|>",
    "<|user|>",
    "<|assistant|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|video|>",
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
]
VOCAB = 256
TOKENS = SPECIALS + [f"w{i}" for i in range(len(SPECIALS), VOCAB)]
IDS = {t: i for i, t in enumerate(TOKENS)}
WORDS = TOKENS[len(SPECIALS) :]
IMAGE = "<|begin_of_image|> <|image|> <|end_of_image|>"
PATCH, MERGE, MAX_SIDE = 4, 2, 48
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + IMAGE + " "
    "{% elif p['type'] == 'text' %}{{ p['text'] }} {% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 3, 3],
    },
)
VISION: dict[str, Any] = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    patch_size=PATCH,
    image_size=16,
    spatial_merge_size=MERGE,
    temporal_patch_size=2,
    attention_bias=True,
)


def _spread(model: torch.nn.Module, seed: int) -> None:
    """Norm weights near 1, small biases, unit-variance embeddings, the other weights scaled by their
    fan-in (conv kernels included): outputs that differ from prompt to prompt and image to image."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
        elif name.endswith("bias"):
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        elif "embed" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif "lm_head" in name:  # logits of std ~3: greedy picks vary, never collapse onto one token
            p.copy_(3 * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)


# GLM-4.5V's decoder (Glm4vMoeForConditionalGeneration): the first layer dense, the second 4 routed
# experts (2 a token, the grouped sigmoid router) and a shared one; rotate-half partial RoPE.
MOE_TEXT: dict[str, Any] = dict(
    TEXT,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.5,
    attention_bias=True,
)


def make_glm4v_checkpoint(root: str | os.PathLike, seed: int = 0, moe: bool = False) -> str:
    """GLM-4.1V's checkpoint folder, or with moe GLM-4.5V's (the same tower, MOE_TEXT's decoder)."""
    import transformers
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    folder = os.path.join(str(root), f"glm4v{'_moe' if moe else ''}_{seed}")
    config_class = transformers.Glm4vMoeConfig if moe else transformers.Glm4vConfig
    cfg = config_class(
        text_config=MOE_TEXT if moe else TEXT,
        vision_config=VISION,
        image_token_id=IDS["<|image|>"],
        video_token_id=IDS["<|video|>"],
        image_start_token_id=IDS["<|begin_of_image|>"],
        image_end_token_id=IDS["<|end_of_image|>"],
        video_start_token_id=IDS["<|begin_of_video|>"],
        video_end_token_id=IDS["<|end_of_video|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model_class = (
        transformers.Glm4vMoeForConditionalGeneration if moe else transformers.Glm4vForConditionalGeneration
    )
    model = model_class(cfg).eval()
    with torch.no_grad():
        _spread(model, seed)
    model.config.eos_token_id = IDS["<|user|>"]
    model.save_pretrained(folder)
    save_word_tokenizer(folder, IDS, SPECIALS, CHAT_TEMPLATE, eos_token="<|user|>", pad_token="<|endoftext|>")
    unit = PATCH * MERGE
    Glm4vImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": 2 * unit * unit, "longest_edge": 2 * MAX_SIDE * MAX_SIDE},
    ).save_pretrained(folder)
    return folder


def hf_reference(folder: str) -> ProcessorReference:
    """transformers' Glm4vProcessor (its PIL image processor) and greedy generate. The processor insists
    on a video processor, which needs torchvision (not installed here): it is built without the class
    check and never handed a video."""
    from unittest import mock

    from transformers import AutoTokenizer
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.glm4v.processing_glm4v import Glm4vProcessor
    from transformers.processing_utils import ProcessorMixin

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None):
        processor = Glm4vProcessor(
            image_processor=Glm4vImageProcessorPil.from_pretrained(folder),
            tokenizer=AutoTokenizer.from_pretrained(folder),
            video_processor=object(),
        )
    return ProcessorReference(folder, processor)
