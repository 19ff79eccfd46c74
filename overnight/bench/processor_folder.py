"""Processor files for a vision-language preset, so that transformers' AutoProcessor, and so vLLM, can load
a folder that holds only the preset's config.json (bench/vllm_throughput.py on an image workload).

vLLM runs the HF processor even on token-id prompts (vLLM 0.26, multimodal/processing/processor.py): the
images go through it with a dummy text of placeholders (`<|image_pad|>` per image for Qwen2(.5)-VL,
`<|vision_start|><|image_pad|><|vision_end|>` for Qwen3-VL) to get the pixels and patch grids, and the
prompt's single pad per image is then replaced by grid_t * grid_h * grid_w / merge_size**2 pads, the pad
id looked up in the tokenizer (`vocab["<|image_pad|>"]`, or the encoding of that string). So the
tokenizer needs no words, only the model's special tokens at their real ids: here a word-level
vocabulary of filler tokens `<tN>` for every other id below the model's vocab size (the ids vLLM checks
prompts against), with the special tokens added as such.

Written: tokenizer.json + tokenizer_config.json, the published preprocessor_config.json
(multimodal/qwen_pixels.py: the same pixels and token counts as ours), and a video_preprocessor_config.json
naming the family's video processor (the HF processor loads one; no video is sent).
"""

from __future__ import annotations

import json
import os
from typing import Any

from overnight.arch import ModelArch
from overnight.models.registry import arch_from_hf_config
from overnight.multimodal.qwen_pixels import published_preprocessor_config

VIDEO_PROCESSOR = {
    "qwen2_vl": "Qwen2VLVideoProcessor",
    "qwen2_5_vl": "Qwen2VLVideoProcessor",
    "qwen3_vl": "Qwen3VLVideoProcessor",
}


def special_tokens(cfg: dict[str, Any], arch: ModelArch) -> dict[str, int]:
    """Qwen's special tokens the processors name, at the ids config.json gives them."""
    v = arch.vision
    if v is None or v.vision_start_token_id is None or v.vision_end_token_id is None:
        raise ValueError("not a Qwen vision-language config (no vision tower or vision start / end ids)")
    tokens = {
        "<|vision_start|>": v.vision_start_token_id,
        "<|vision_end|>": v.vision_end_token_id,
        "<|image_pad|>": v.image_token_id,
    }
    for name, key in (("<|video_pad|>", "video_token_id"), ("<|vision_pad|>", "vision_token_id")):
        if isinstance(cfg.get(key), int):
            tokens[name] = cfg[key]
    eos = cfg.get("eos_token_id", (cfg.get("text_config") or {}).get("eos_token_id"))
    if isinstance(eos, int):
        tokens["<|im_end|>"] = eos
    if len(set(tokens.values())) != len(tokens):
        raise ValueError(f"two special tokens share an id: {tokens}")
    return tokens


def write_processor_files(folder: str) -> dict[str, int]:
    """Write the processor files beside `folder`/config.json; returns the special tokens and their ids."""
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    arch = arch_from_hf_config(cfg)
    assert arch.vision is not None  # special_tokens refuses a model without one
    specials = special_tokens(cfg, arch)
    name_of = {i: t for t, i in specials.items()}
    if max(name_of) >= arch.vocab_size:
        raise ValueError(f"special token ids {sorted(name_of)} exceed the vocabulary ({arch.vocab_size})")
    unk = "<t0>" if 0 not in name_of else name_of[0]
    vocab = {name_of.get(i, f"<t{i}>"): i for i in range(arch.vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token=unk))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    eos = "<|im_end|>" if "<|im_end|>" in specials else None
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=unk, eos_token=eos).save_pretrained(folder)

    image = published_preprocessor_config(arch.vision)
    video = {
        "video_processor_type": VIDEO_PROCESSOR[arch.vision.kind],
        "processor_class": image["processor_class"],
        **{
            k: image[k]
            for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
        },
    }
    for name, content in (("preprocessor_config.json", image), ("video_preprocessor_config.json", video)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f, indent=2)
    return specials
