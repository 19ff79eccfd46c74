"""A tiny random Llama 4 with images (a ViT of 2 layers on 16-pixel tiles of 4-pixel patches, pixel
shuffle 2 x 2: 4 tokens a tile, canvases of 1 to 4 tiles plus the whole image; a 4-layer Llama 4 text
model with chunked RoPE layers, a NoPE layer and MoE layers) and a word-level tokenizer holding Llama 4's
image tokens, with a chat template that writes each image part as <|image|>; plus transformers'
reference: its Llama4Processor's expansion of <|image|>, its Llama4ImageProcessor's pixels (where
torchvision is installed; else ours, overnight/multimodal/llama4_prompt.py) and greedy generate."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from tests.tiny_vl import ProcessorReference, save_word_tokenizer

SPECIALS = [
    "<unk>",
    "<|begin_of_text|>",
    "<|header_start|>",
    "<|header_end|>",
    "<|eot|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|image|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
]
ROLES = ["system", "user", "assistant"]  # in the vocabulary: an <unk> (id 0) would be HF generate's padding
VOCAB = 256
TOKENS = SPECIALS + ROLES + [f"w{i}" for i in range(len(SPECIALS) + len(ROLES), VOCAB)]
IDS = {t: i for i, t in enumerate(TOKENS)}
WORDS = TOKENS[len(SPECIALS) + len(ROLES) :]
PATCH, TILE, MAX_TILES = 4, 16, 4
PER_TILE = (TILE // PATCH // 2) ** 2  # 4
CHAT_TEMPLATE = (
    "<|begin_of_text|> {% for m in messages %}<|header_start|> {{ m['role'] }} <|header_end|> "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|image|> {% elif p['type'] == 'text' %}{{ p['text'] }} {% endif %}"
    "{% endfor %}{% endif %}<|eot|> {% endfor %}"
    "{% if add_generation_prompt %}<|header_start|> assistant <|header_end|> {% endif %}"
)
TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=16,
    floor_scale=4, attn_scale=0.5, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=4, pad_token_id=0,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)  # fmt: skip
VISION: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=TILE,
    patch_size=PATCH, vision_output_dim=48, projector_input_dim=48, projector_output_dim=48,
)  # fmt: skip


def make_llama4_vl_checkpoint(root: str | os.PathLike, seed: int = 0, **vision: Any) -> str:
    """The checkpoint folder (vision_config fields overridden by `vision`), its tokenizer and its
    preprocessor_config.json (as the published one, at the tiny tile size)."""
    import transformers

    from tests.tiny_models import _spread_weights

    folder = os.path.join(str(root), f"llama4_vl_{seed}")
    cfg = transformers.Llama4Config(
        text_config=transformers.Llama4TextConfig(**TEXT),
        vision_config=transformers.Llama4VisionConfig(**{**VISION, **vision}),
        boi_token_index=IDS["<|image_start|>"],
        eoi_token_index=IDS["<|image_end|>"],
        image_token_index=IDS["<|patch|>"],
    )
    torch.manual_seed(seed)
    model = transformers.Llama4ForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        _spread_weights(model, seed)
        for name, p in model.named_parameters():  # the tower's LayerNorms near 1, as trained ones are
            if "layernorm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
    model.config.eos_token_id = IDS["<|eot|>"]
    model.save_pretrained(folder)
    save_word_tokenizer(folder, IDS, SPECIALS, CHAT_TEMPLATE, eos_token="<|eot|>", pad_token="<unk>")
    processor = {
        "image_processor_type": "Llama4ImageProcessorFast",
        "processor_class": "Llama4Processor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "max_patches": MAX_TILES,
        "resample": 2,
        "rescale_factor": 1 / 255,
        "resize_to_max_canvas": False,
        "size": {"height": TILE, "width": TILE},
    }
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f)
    return folder


def hf_image_processor(folder: str) -> Any | None:
    """transformers' Llama4ImageProcessor from the folder, or None without torchvision (its backend)."""
    try:
        from transformers.models.llama4.image_processing_llama4 import Llama4ImageProcessor
    except ImportError:
        return None
    with open(os.path.join(folder, "preprocessor_config.json")) as f:
        cfg = json.load(f)
    keep = ("size", "max_patches", "resize_to_max_canvas", "image_mean", "image_std", "rescale_factor")
    return Llama4ImageProcessor(**{k: cfg[k] for k in keep})


class Llama4Reference:
    """transformers' Llama4Processor in the parts that run without torchvision: each <|image|> of the
    text replaced by its _prompt_split_image string for the image's tiles, then the tokenizer; the
    pixels from transformers' image processor where it runs, else from ours."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoTokenizer

        from overnight.models.registry import arch_from_hf_config
        from overnight.multimodal.llama4_prompt import llama4_image_processor

        with open(os.path.join(folder, "config.json")) as f:
            vision = arch_from_hf_config(json.load(f)).vision
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.pixels = hf_image_processor(folder) or llama4_image_processor(vision, folder)

    def __call__(self, text: str, images: list[Any] | None, return_tensors: str) -> dict[str, Any]:
        from transformers.models.llama4.processing_llama4 import Llama4Processor

        pieces = text.split("<|image|>")
        assert len(pieces) == len(images or []) + 1
        out, tiles = pieces[0], []
        for image, rest in zip(images or [], pieces[1:]):
            got = self.pixels(images=[image], return_tensors="pt")
            tiles.append(got["pixel_values"].float())
            ratio = [int(r) for r in got["aspect_ratios"][0]]
            out += Llama4Processor._prompt_split_image(None, ratio, PER_TILE) + rest  # type: ignore[arg-type]
        enc: dict[str, Any] = {"input_ids": torch.tensor([self.tokenizer(out)["input_ids"]])}
        if tiles:
            enc["pixel_values"] = torch.cat(tiles)
        return enc


def hf_reference(folder: str) -> ProcessorReference:
    return ProcessorReference(folder, Llama4Reference(folder))
