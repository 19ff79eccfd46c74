"""The Qwen (and GLM-4.1V) towers' image preprocessing when a model comes without its
preprocessor_config.json (a dummy preset, a bare config folder): the published checkpoints' settings, so an image becomes the same pixels
and the same number of image tokens as with the real files.

transformers' own defaults (min 56 x 56, max 28 x 28 x 1280 pixels, CLIP's mean and std) are Qwen2-VL's;
the published files differ (each value read from the checkpoints' preprocessor_config.json):
- Qwen2-VL (2B / 7B / 72B-Instruct) and Qwen2.5-VL (3B / 7B / 32B / 72B-Instruct): min_pixels 3136,
  max_pixels 12845056, CLIP mean / std;
- Qwen3-VL (dense and MoE) and Qwen3.5: size {shortest_edge: 65536, longest_edge: 16777216}, mean and
  std 0.5 per channel;
- GLM-4.1V-Thinking (its own processor, Glm4vImageProcessorPil, whose longest_edge bounds t x h x w
  with t the 2 frames of an image): size {shortest_edge: 12544, longest_edge: 9633792}, CLIP mean / std.
Patch, temporal patch and merge sizes always come from the model's vision_config (VisionArch).
"""

from __future__ import annotations

import os
from typing import Any

from overnight.arch import VisionArch

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# VisionArch.kind -> (min_pixels, max_pixels, image_mean, image_std, the HF processor class)
PUBLISHED: dict[str, tuple[int, int, list[float], list[float], str]] = {
    "qwen2_vl": (3136, 12845056, CLIP_MEAN, CLIP_STD, "Qwen2VLProcessor"),
    "qwen2_5_vl": (3136, 12845056, CLIP_MEAN, CLIP_STD, "Qwen2_5_VLProcessor"),
    "qwen3_vl": (65536, 16777216, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5], "Qwen3VLProcessor"),
    "glm4v": (12544, 9633792, CLIP_MEAN, CLIP_STD, "Glm4vProcessor"),
}


def published_preprocessor_config(vision: VisionArch) -> dict[str, Any]:
    """The preprocessor_config.json a published checkpoint of this tower ships (its values; the keys
    transformers 5 reads)."""
    if vision.kind not in PUBLISHED:
        raise ValueError(f"no published image preprocessing known for a {vision.kind!r} tower")
    lo, hi, mean, std, processor = PUBLISHED[vision.kind]
    return {
        "size": {"shortest_edge": lo, "longest_edge": hi},
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.spatial_merge_size,
        "image_mean": mean,
        "image_std": std,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "resample": 3,  # bicubic
        "rescale_factor": 1 / 255,
        "image_processor_type": "Glm4vImageProcessor" if vision.kind == "glm4v" else "Qwen2VLImageProcessor",
        "processor_class": processor,
    }


def qwen_image_processor(vision: VisionArch, model_path: str | None) -> Any:
    """transformers' PIL image processor (no torchvision needed): the checkpoint's preprocessor_config.json
    when `model_path` has one, else the published settings of this tower."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # GLM-4.1V's resizing differs from Qwen's (its own smart_resize): its class, whatever the file says
    cls = Glm4vImageProcessorPil if vision.kind == "glm4v" else Qwen2VLImageProcessorPil
    if model_path and os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
        return cls.from_pretrained(model_path)
    if vision.kind not in PUBLISHED:  # an unknown Qwen-style tower: transformers' defaults
        return cls(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
        )
    cfg = published_preprocessor_config(vision)
    keep = ("size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
    return cls(**{k: cfg[k] for k in keep})
