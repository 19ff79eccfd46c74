"""A tiny random Idefics3 (SmolVLM) checkpoint: SigLIP of 2 layers on 32-pixel frames of 4-pixel patches,
pixel shuffle 2 x 2 (16 tokens a frame), images resized to 64 pixels on the longest edge (so at most
2 x 2 tiles plus the global image), a 2-layer Llama decoder; a word-level tokenizer holding the image
tokens (<fake_token_around_image>, <image>, <global-img>, <row_r_col_c>) and the newline tokens the
prompt expansion writes, with a chat template that writes each image part as <image>; plus
transformers' own Idefics3Processor and greedy generate as the reference."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.tiny_vl import ProcessorReference, save_word_tokenizer

SPECIALS = [
    "<unk>",
    "<|endoftext|>",
    "<|im_start|>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
]
GRID = [f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)]
NEWLINES = ["\n", "\n\n"]
VOCAB = 256
TOKENS = SPECIALS + GRID + NEWLINES
TOKENS += [f"w{i}" for i in range(len(TOKENS), VOCAB)]
IDS = {t: i for i, t in enumerate(TOKENS)}
WORDS = TOKENS[len(SPECIALS) + len(GRID) + len(NEWLINES) :]
PATCH, FRAME, LONGEST = 4, 32, 64
PER_FRAME = (FRAME // PATCH // 2) ** 2  # 16
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image> "
    "{% elif p['type'] == 'text' %}{{ p['text'] }} {% endif %}{% endfor %}{% endif %}<end_of_utterance> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> w40 {% endif %}"
)


def make_smolvlm_checkpoint(
    root: str | os.PathLike,
    seed: int = 0,
    architecture: str = "Idefics3ForConditionalGeneration",
    **changes: Any,
) -> str:
    """The checkpoint folder (Idefics3ForConditionalGeneration, or SmolVLMForConditionalGeneration: the
    same model under SmolVLM2's name); `changes` override the top level's config fields."""
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from tests.tiny_models import _spread_weights

    folder = os.path.join(str(root), f"smolvlm_{architecture}_{seed}")
    config_class = (
        transformers.SmolVLMConfig if architecture.startswith("SmolVLM") else transformers.Idefics3Config
    )
    cfg = config_class(
        text_config={
            "model_type": "llama",
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-5,
            "pad_token_id": IDS["<|endoftext|>"],
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": FRAME,
            "patch_size": PATCH,
        },
        image_token_id=IDS["<image>"],
        scale_factor=2,
        pad_token_id=IDS["<|endoftext|>"],
        tie_word_embeddings=False,
        **changes,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(cfg).eval()
    with torch.no_grad():
        _spread_weights(model, seed)
        gen = torch.Generator().manual_seed(seed + 100)
        for name, p in model.named_parameters():  # SigLIP's LayerNorms near 1, as trained ones are
            if name.endswith(("layer_norm1.weight", "layer_norm2.weight", "post_layernorm.weight")):
                p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
    model.config.eos_token_id = IDS["<end_of_utterance>"]
    model.config.bos_token_id = IDS["<|endoftext|>"]
    model.save_pretrained(folder)

    save_word_tokenizer(
        folder,
        IDS,
        SPECIALS,
        CHAT_TEMPLATE,
        added=tuple(NEWLINES),
        eos_token="<end_of_utterance>",
        pad_token="<|endoftext|>",
    )
    Idefics3ImageProcessorPil(
        size={"longest_edge": LONGEST}, max_image_size={"longest_edge": FRAME}
    ).save_pretrained(folder)
    return folder


def hf_reference(folder: str) -> ProcessorReference:
    """transformers' Idefics3Processor (its PIL image processor) and greedy generate."""
    from transformers import AutoTokenizer
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil.from_pretrained(folder),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        image_seq_len=PER_FRAME,
    )
    return ProcessorReference(folder, processor)
