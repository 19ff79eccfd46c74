"""A tiny random Gemma 3 checkpoint with images (SigLIP of 2 layers at 56 x 56 pixels in 7-pixel patches,
16 tokens per image, a 2-layer decoder with a sliding layer of window 24) and a word-level tokenizer
holding Gemma's image tokens and "\\n\\n", with a chat template that writes each image part as
<start_of_image>; plus transformers' own processor and greedy generate as the reference."""

from __future__ import annotations

import os

import torch

from tests.tiny_vl import ProcessorReference, save_word_tokenizer

SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
VOCAB = 256
TOKENS = [*SPECIALS, "\n\n", "user", "model"] + [f"w{i}" for i in range(len(SPECIALS) + 3, VOCAB)]
IDS = {t: i for i, t in enumerate(TOKENS)}
WORDS = TOKENS[len(SPECIALS) + 3 :]
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE, WINDOW = 56, 7, 16, 24
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn> "
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }} {% else %}<start_of_image> {% endif %}{% endfor %}{% endif %}"
    " <end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn> model {% endif %}"
)


def make_gemma_vl_checkpoint(
    root: str | os.PathLike, seed: int = 0, tokens_per_image: int = TOKENS_PER_IMAGE
) -> str:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    folder = os.path.join(str(root), "gemma3_vl")
    cfg = Gemma3Config(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=512,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=PATCH,
            vision_use_head=False,
        ),
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=IDS["<start_of_image>"],
        eoi_token_index=IDS["<end_of_image>"],
        image_token_index=IDS["<image_soft_token>"],
        eos_token_id=IDS["<eos>"],
        bos_token_id=IDS["<bos>"],
        pad_token_id=IDS["<pad>"],
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg)
    # Spread the random weights so greedy tokens differ from prompt to prompt (small embeddings: with
    # Gemma's sqrt(hidden) scale and tied logits, larger ones make every prompt repeat its last token).
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, (0.03 if "embed_tokens" in name else 0.2) if p.dim() > 1 else 0.05)
    model.save_pretrained(folder)

    save_word_tokenizer(
        folder,
        IDS,
        SPECIALS,
        CHAT_TEMPLATE,
        added=("\n\n",),
        eos_token="<eos>",
        bos_token="<bos>",
        pad_token="<pad>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(folder)
    return folder


def hf_reference(folder: str, tokens_per_image: int = TOKENS_PER_IMAGE) -> ProcessorReference:
    """transformers' Gemma3Processor (its PIL image processor) and greedy generate."""
    from transformers import AutoTokenizer
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil.from_pretrained(folder),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        image_seq_length=tokens_per_image,
    )
    return ProcessorReference(folder, processor)


# The tensor-naming layouts transformers has saved Gemma 3 image checkpoints in (and quantizers have
# written ignore lists in): 4.x's language_model.model.* / vision_tower.vision_model.*, and 5.x's
# in-memory names model.language_model.* / model.vision_tower.* / model.multi_modal_projector.*.
GEMMA_LAYOUTS = ("transformers4", "transformers5")


def gemma_name(name: str, layout: str) -> str:
    """A tensor or module name of a Gemma 3 image checkpoint (any layout) in `layout`."""
    parts = name.split(".")
    while len(parts) > 1 and parts[0] in ("model", "language_model"):
        parts.pop(0)
    head, rest = parts[0], ".".join(parts[1:]).removeprefix("vision_model.")
    old = layout == "transformers4"
    if head == "vision_tower":
        return f"vision_tower.vision_model.{rest}" if old else f"model.vision_tower.{rest}"
    if head == "multi_modal_projector":
        return f"{head}.{rest}" if old else f"model.{head}.{rest}"
    if head == "lm_head":
        return ("language_model." if old else "") + ".".join(parts)
    return ("language_model.model." if old else "model.language_model.") + ".".join(parts)


def in_gemma_layout(src: str | os.PathLike, dst: str | os.PathLike, layout: str) -> str:
    """A copy of checkpoint folder src with its tensors named in `layout`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file({gemma_name(k, layout): v for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"))
    return str(dst)


def gemma_cases(n: int = 2) -> list[tuple[str, list]]:
    """n prompts, every other one with an image (the text before it: 3 words, after it 4)."""
    from tests.tiny_vl import image, words

    return [
        (f"<bos> {words(3, i, WORDS)} <start_of_image> {words(4, i + 10, WORDS)}", [image(30, 40, i)])
        if i % 2
        else (f"<bos> {words(7, i, WORDS)}", [])
        for i in range(n)
    ]


def gemma_prompts(n: int = 6) -> list:
    """gemma_cases as LLM.generate's prompts."""
    return [{"prompt": t, "multi_modal_data": {"image": imgs}} if imgs else t for t, imgs in gemma_cases(n)]
