"""Captioning requests: one synthetic image per request in a fixed Qwen chat prompt, as token ids.

The prompt is what the Qwen2.5-VL chat template renders for a user turn of one image and "Describe this
image.", tokenized by the Qwen2 / Qwen3 tokenizer (Qwen2-VL, Qwen2.5-VL and Qwen3-VL share its ids):

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\n
    <|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\\n<|im_start|>assistant\\n

with the model's own vision_start / image_pad / vision_end ids (config.json), one image pad per image as
vLLM's prompts carry it: each engine expands it to the image's token count itself.

Images are drawn with numpy from (seed, request index), so every request has its own picture (no
prefix-cache or encoder-cache hit between requests) and the same seed gives the same pixels: a colour
gradient at a random angle between two random colours, plus per-pixel noise.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from overnight.arch import ModelArch

# <|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n
SYSTEM_AND_USER = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198]
DESCRIBE = [74785, 419, 2168, 13]  # Describe this image.
ASSISTANT = [151645, 198, 151644, 77091, 198]  # <|im_end|>\n<|im_start|>assistant\n
NOISE = 24  # per-pixel noise amplitude, in 0-255 levels


def caption_prompt_ids(arch: ModelArch) -> list[int]:
    """The caption prompt with one image placeholder, for a Qwen vision-language model. Raises
    ValueError naming what the model lacks."""
    v = arch.vision
    if v is None:
        raise ValueError(
            f"{arch.architecture} takes no images: an image workload needs a vision-language model"
        )
    if v.kind not in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        raise ValueError(f"caption prompts are Qwen chat prompts; a {v.kind!r} tower is not supported")
    if v.vision_start_token_id is None or v.vision_end_token_id is None:
        raise ValueError("config.json lacks vision_start_token_id / vision_end_token_id")
    ids = [
        *SYSTEM_AND_USER,
        v.vision_start_token_id,
        v.image_token_id,
        v.vision_end_token_id,
        *DESCRIBE,
        *ASSISTANT,
    ]
    if max(ids) >= arch.vocab_size:
        raise ValueError(
            f"the caption prompt's ids exceed the vocabulary ({arch.vocab_size}): not a Qwen tokenizer"
        )
    return ids


def synthetic_image(width: int, height: int, seed: int, index: int) -> Any:
    """An RGB PIL image of width x height, the same for the same (seed, index)."""
    from PIL import Image

    rng = np.random.default_rng([seed, index])
    c0, c1 = rng.uniform(0, 255, (2, 3)).astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    x = np.arange(width, dtype=np.float32) * np.float32(np.cos(angle))
    y = np.arange(height, dtype=np.float32) * np.float32(np.sin(angle))
    t = y[:, None] + x[None, :]
    t = (t - t.min()) / max(float(t.max() - t.min()), 1.0)
    base = c0 + t[..., None] * (c1 - c0)
    noise = rng.integers(-NOISE, NOISE + 1, (height, width, 3), dtype=np.int8)
    pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")
