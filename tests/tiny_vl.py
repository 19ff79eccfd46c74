"""Tiny random Qwen2.5-VL / Qwen3-VL / Qwen3.5 (dense and MoE) checkpoints (vision towers of depth 2,
width 32) with a word-level tokenizer holding Qwen's image special tokens and a chat template that
renders image parts as <|vision_start|><|image_pad|><|vision_end|>, plus the image processor's
preprocessor_config.json."""

from __future__ import annotations

import base64
import io
import os
import random
from typing import Any

import numpy as np
import torch

from tests.tiny_hybrid import LINEAR_LAYERS

SPECIALS = [
    "<unk>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
ROLES = ["system", "user", "assistant"]
VOCAB = 256
WORDS = [f"w{i}" for i in range(len(SPECIALS) + len(ROLES), VOCAB)]
TOKENS = SPECIALS + ROLES + WORDS
IMAGE_PAD = TOKENS.index("<|image_pad|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }} {% else %}<|vision_start|><|image_pad|><|vision_end|> "
    "{% endif %}{% endfor %}{% endif %} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_vl_moe": 16, "qwen3_5": 16, "qwen3_5_moe": 16}
# Qwen3.5's hybrid decoder: linear and full attention layers; M-RoPE over half of each head (rotary 16,
# sections [2, 3, 3] fill its 8 frequencies, so all three axes turn some).
HYBRID_TEXT: dict[str, Any] = dict(
    head_dim=32,
    **LINEAR_LAYERS,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
)


def make_vl_checkpoint(root: str | os.PathLike, kind: str, seed: int = 0) -> str:
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = os.path.join(str(root), kind)
    ids = {t: i for i, t in enumerate(TOKENS)}
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=ids["<|im_end|>"],
        bos_token_id=None,
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, spatial_merge_size=2
    )
    torch.manual_seed(seed)
    if kind == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        cfg = Qwen2_5_VLConfig(
            text_config=text,
            vision_config={**vision, "patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1]},
            **common,
        )
        model: Any = Qwen2_5_VLForConditionalGeneration(cfg)
    elif kind in ("qwen3_5", "qwen3_5_moe"):
        import transformers

        from tests.tiny_models import _spread_weights

        text.update(HYBRID_TEXT)
        qwen35_vision = {**vision, "patch_size": 16, "num_position_embeddings": 16}
        if kind == "qwen3_5":
            text["intermediate_size"] = 96
            cfg = transformers.Qwen3_5Config(text_config=text, vision_config=qwen35_vision, **common)
            model = transformers.Qwen3_5ForConditionalGeneration(cfg)
        else:
            text.update(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=24,
                shared_expert_intermediate_size=32,
            )
            cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=qwen35_vision, **common)
            model = transformers.Qwen3_5MoeForConditionalGeneration(cfg)
        # The hybrid tests' spread (unit-variance projections, norms near 1): the delta rule stays tame.
        with torch.no_grad():
            _spread_weights(model, seed)
        model.eval()
    elif kind == "qwen3_vl_moe":
        from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

        text["head_dim"] = 16
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        }
        cfg = Qwen3VLMoeConfig(
            text_config=text,
            vision_config={
                **vision,
                "patch_size": 16,
                "num_position_embeddings": 16,
                "deepstack_visual_indexes": [0, 1],
            },
            **common,
        )
        model = Qwen3VLMoeForConditionalGeneration(cfg)
    else:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        text["head_dim"] = 16
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        }
        cfg = Qwen3VLConfig(
            text_config=text,
            vision_config={
                **vision,
                "patch_size": 16,
                "num_position_embeddings": 16,
                "deepstack_visual_indexes": [0, 1],
            },
            **common,
        )
        model = Qwen3VLForConditionalGeneration(cfg)
    if kind not in ("qwen3_5", "qwen3_5_moe"):
        # Spread the random weights so greedy tokens differ from prompt to prompt.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2 if p.dim() > 1 else 0.05)
    model.save_pretrained(folder)

    backend = RustTokenizer(WordLevel(ids, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE
    )
    hf_tok.save_pretrained(folder)
    p = PATCH[kind]
    Qwen2VLImageProcessorPil(
        patch_size=p, merge_size=2, temporal_patch_size=2, min_pixels=(2 * p) ** 2, max_pixels=(8 * p) ** 2
    ).save_pretrained(folder)
    return folder


def image(w: int, h: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def cpu_flags(folder: str) -> list[str]:
    """The engine flags of the image tests' CLI runs: the tiny checkpoint in float32 on the CPU, an
    8 MiB KV pool."""
    return [
        "--model",
        folder,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--kv-cache-memory-bytes",
        str(8 << 20),
    ]


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_uri(img) -> str:
    """The image as a PNG data URI, as a chat message's image_url carries it."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()


def words(n: int, seed: int, vocabulary: list[str] = WORDS) -> str:
    """n words of the tokenizer's vocabulary (each one token), drawn with `seed`."""
    rng = random.Random(seed)
    return " ".join(rng.choice(vocabulary) for _ in range(n))


def hf_greedy(
    folder: str, ids: list[int], images: list[Any], new_tokens: int, model: Any = None
) -> list[int]:
    """transformers' greedy generate on one prompt (ids with one image pad per image), its images
    preprocessed by the same HF image processor."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = model or AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    kwargs: dict[str, Any] = {}
    expanded = list(ids)
    if images:
        proc = Qwen2VLImageProcessorPil.from_pretrained(folder)
        out = proc(images=images, return_tensors="pt")
        kwargs["pixel_values"] = out["pixel_values"]
        kwargs["image_grid_thw"] = out["image_grid_thw"]
        counts = (out["image_grid_thw"].prod(-1) // 4).tolist()
        expanded = []
        k = 0
        for t in ids:
            if t == IMAGE_PAD:
                expanded.extend([IMAGE_PAD] * counts[k])
                k += 1
            else:
                expanded.append(t)
    input_ids = torch.tensor([expanded])
    kwargs["mm_token_type_ids"] = (input_ids == IMAGE_PAD).int()
    with torch.inference_mode():
        gen = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            eos_token_id=[],
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return gen[0, input_ids.shape[1] :].tolist()
