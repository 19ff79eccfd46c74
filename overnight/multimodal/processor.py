"""Prompt + images -> token ids with each image's placeholder expanded, and MultiModalInputs.

Pixels come from the checkpoint's own HF image processor (its preprocessor_config.json, else the
published checkpoints' settings: qwen_pixels.py), the PIL one (transformers' `Qwen2VLImageProcessorPil`),
which needs neither torchvision nor a GPU. Images are preprocessed in a pool of threads (PIL decoding and
resizing release the GIL), so the device does not wait on JPEG decoding.

A prompt marks each image with one image-pad token (`<|vision_start|><|image_pad|><|vision_end|>`, as
the chat template writes it and vLLM's prompts do; GLM-4.1V's <|begin_of_image|><|image|><|end_of_image|>
the same way); it becomes as many pad tokens as the image has merged patches. The expansion and the M-RoPE positions here are the Qwen families'; Gemma 3's (a fixed
count of soft tokens between begin / end markers, Gemma3ImageProcessorPil's pixels) is in
gemma_prompt.py and Mistral 3's (rows of [IMG] tokens closed by [IMG_BREAK] / [IMG_END],
PixtralImageProcessorPil's pixels) in pixtral_prompt.py and InternVL's (<img>, the tiles' <IMG_CONTEXT>
tokens, </img>; GotOcr2ImageProcessorPil's tiles) in internvl_prompt.py and Idefics3 / SmolVLM's
(<image> becomes its tiles' and global image's frames between markers, each frame its own ImageInput;
Idefics3ImageProcessorPil's frames) in idefics3_prompt.py and Llama 4's (<|image|> becomes
its tiles' <|patch|> tokens between separators; Llama4ImageProcessor's tiles) in llama4_prompt.py,
chosen by VisionArch.kind; each returns the same MultiModalInputs.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from overnight.arch import VisionArch
from overnight.errors import InvalidRequestError
from overnight.multimodal.gemma_prompt import GemmaPrompt, gemma3_image_processor
from overnight.multimodal.idefics3_prompt import Idefics3Prompt, idefics3_image_processor
from overnight.multimodal.inputs import ImageInput, MultiModalInputs, Pixels
from overnight.multimodal.internvl_prompt import InternVLPrompt, internvl_image_processor
from overnight.multimodal.llama4_prompt import Llama4Prompt, llama4_image_processor
from overnight.multimodal.media import MediaError, MediaPolicy, load_image
from overnight.multimodal.pixtral_prompt import PixtralPrompt, pixtral_image_processor
from overnight.multimodal.qwen_pixels import qwen_image_processor
from overnight.options import DEFAULT_IMAGE_LIMIT, image_limit

T = TypeVar("T")


def parse_image_limit(value: str | int | None) -> int:
    """--limit-mm-per-prompt: a number, or vLLM's JSON {"image": N} (options.image_limit)."""
    return value if isinstance(value, int) else image_limit(value)


class ImageProcessor:
    def __init__(
        self,
        vision: VisionArch,
        model_path: str | None,
        policy: MediaPolicy,
        image_limit: int = DEFAULT_IMAGE_LIMIT,
        num_threads: int = min(8, max(2, os.cpu_count() or 2)),
        tokenizer_path: str | None = None,
    ) -> None:
        self.vision = vision
        self.policy = policy
        self.image_limit = image_limit
        self.gemma: GemmaPrompt | None = None
        self.pixtral: PixtralPrompt | None = None
        self.internvl: InternVLPrompt | None = None
        self.llama4: Llama4Prompt | None = None
        self.idefics3: Idefics3Prompt | None = None
        self.hf_kwargs: dict[str, Any] = {}
        self.hf: Any
        if vision.kind == "gemma3":
            self.hf = gemma3_image_processor(vision, model_path)
            self.gemma = GemmaPrompt(vision, tokenizer_path or model_path)
        elif vision.kind == "pixtral":
            self.hf = pixtral_image_processor(vision, model_path)
            self.pixtral = PixtralPrompt(vision, tokenizer_path or model_path)
            self.hf_kwargs = self.pixtral.hf_kwargs
        elif vision.kind == "internvl":
            self.hf = internvl_image_processor(vision, model_path)
            self.internvl = InternVLPrompt(vision, tokenizer_path or model_path)
            self.hf_kwargs = self.internvl.hf_kwargs
        elif vision.kind == "idefics3":
            self.hf = idefics3_image_processor(vision, model_path)
            self.idefics3 = Idefics3Prompt(vision, tokenizer_path or model_path)
            self.hf_kwargs = self.idefics3.hf_kwargs
        elif vision.kind == "llama4":
            self.hf = llama4_image_processor(vision, model_path)
            self.llama4 = Llama4Prompt(vision, tokenizer_path or model_path)
        else:
            self.hf = qwen_image_processor(vision, model_path)
        # Images of one prompt go to `pool`; whole prompts (each waiting on its images) to `prompt_pool`,
        # so a prompt never waits for a worker that is itself waiting.
        self.pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="overnight-images")
        self.prompt_pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="overnight-prompts")
        # Images decoded ahead of their prompt (prefetched), by source URL; bounded, oldest dropped.
        self._ahead: OrderedDict[str, Future[Pixels]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_ahead = 256

    def pixels(self, source: Any) -> Pixels:
        """(pixel_values, grid (t, h, w), content hash) of one image. The hash is of the decoded image
        (its mode, size and pixels), which this engine's processor turns into the same pixel values
        every time: a 448 x 448 image hashes 0.6 MB, its float32 patches 4.8 MB (3 ms of sha256)."""
        image = load_image(source, self.policy)
        try:
            out = self.hf(images=[image], return_tensors="pt", **self.hf_kwargs)
            digest = hashlib.sha256(f"{image.mode} {image.size}".encode())
            digest.update(image.tobytes())  # decoded by now: a broken file has failed above
        except Exception as e:
            raise MediaError(f"cannot preprocess image: {type(e).__name__}: {e}") from None
        if self.pixtral is not None:  # [1, C, H, W] -> patch rows; its grid (1, H / patch, W / patch)
            pixels, (t, h, w) = self.pixtral.patch_rows(out["pixel_values"])
        elif self.internvl is not None:  # [tiles, C, S, S] -> a row per tile; grid (tiles, S / p, S / p)
            pixels, (t, h, w) = self.internvl.tile_rows(out["pixel_values"])
        elif self.idefics3 is not None:  # [1, F, C, S, S] -> a row per frame; grid (F, tile rows, tile cols)
            pixels, (t, h, w) = self.idefics3.frame_rows(out)
        elif self.llama4 is not None:  # [tiles, C, S, S] -> a row per tile; grid (tiles, canvas patches)
            pixels, (t, h, w) = self.llama4.tile_rows(out)
        elif self.gemma is not None:  # [1, C, S, S] -> one row; its grid is the tower's patch grid
            pixels = out["pixel_values"].float().flatten(1).contiguous()
            t, h, w = self.gemma.grid(out["pixel_values"].shape)
        else:
            pixels = out["pixel_values"].float().contiguous()
            t, h, w = (int(x) for x in out["image_grid_thw"][0].tolist())
        return pixels, (t, h, w), digest.hexdigest()

    def process(self, token_ids: list[int], images: list[Any]) -> tuple[list[int], MultiModalInputs]:
        """Expand the prompt's image placeholders for `images` (in order) and preprocess them in the pool."""
        if images and self.image_limit == 0:
            raise InvalidRequestError(
                f"the prompt has {len(images)} image(s), but this engine runs the model text-only "
                "(limit_mm_per_prompt image 0: no vision tower loaded); restart it with a limit above 0 "
                "to take images"
            )
        if len(images) > self.image_limit:
            raise InvalidRequestError(
                f"{len(images)} images in one prompt; at most {self.image_limit} (--limit-mm-per-prompt)"
            )
        gemma = self.gemma
        pad = self.vision.image_token_id if gemma is None else gemma.boi
        if self.llama4 is not None:
            self.llama4.check_tokens()
            pad = self.llama4.placeholder
        slots = [i for i, t in enumerate(token_ids) if t == pad]
        if len(slots) != len(images):
            name = (
                "<start_of_image>"
                if gemma
                else "[IMG]"
                if self.pixtral
                else "<IMG_CONTEXT>"
                if self.internvl
                else "<|image|>"
                if self.llama4
                else "<image>"
                if self.idefics3
                else "<|image|>"
                if self.vision.kind == "glm4v"
                else "<|image_pad|>"
            )
            raise InvalidRequestError(
                f"the prompt has {len(slots)} image placeholders ({name}) but {len(images)} images were given"
            )
        if gemma is not None:
            gemma.check_newlines()
        if self.pixtral is not None:
            self.pixtral.check_tokens()
        if self.internvl is not None:
            self.internvl.check_tokens()
        if self.idefics3 is not None:
            self.idefics3.check_tokens()
        futures = [self._future(source) for source in images]
        processed = [f.result() for f in futures]  # (waited on here, never inside a worker)
        if gemma is not None:
            return gemma.expand(token_ids, slots, processed)
        if self.pixtral is not None:
            return self.pixtral.expand(token_ids, slots, processed)
        if self.internvl is not None:
            return self.internvl.expand(token_ids, slots, processed)
        if self.llama4 is not None:
            return self.llama4.expand(token_ids, slots, processed)
        if self.idefics3 is not None:
            return self.idefics3.expand(token_ids, slots, processed)
        return expand_placeholders(token_ids, slots, processed, self.vision)

    def _future(self, source: Any) -> Future[Pixels]:
        if isinstance(source, str):
            with self._lock:
                ahead = self._ahead.pop(source, None)
            if ahead is not None:
                return ahead
        return self.pool.submit(self.pixels, source)

    def prefetch(self, sources: Iterable[Any]) -> None:
        """Start decoding these images (URL strings) now, for a prompt that will come soon (none when
        images are refused: text-only)."""
        if self.image_limit == 0:
            return
        with self._lock:
            for source in sources:
                if isinstance(source, str) and source not in self._ahead:
                    self._ahead[source] = self.pool.submit(self.pixels, source)
            while len(self._ahead) > self.max_ahead:
                self._ahead.popitem(last=False)

    def prefetched(
        self, items: Iterable[T], sources_of: Callable[[T], list[Any]], depth: int = 32
    ) -> Iterator[T]:
        """`items` as they come, each yielded `depth` items after its images started decoding in the
        pool: the loop that consumes them (run-batch's, between engine steps) finds them decoded."""
        window: deque[T] = deque()
        for item in items:
            self.prefetch(sources_of(item))
            window.append(item)
            if len(window) > depth:
                yield window.popleft()
        yield from window

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.prompt_pool.shutdown(wait=False)


def expand_placeholders(
    token_ids: list[int],
    slots: list[int],
    processed: list[Pixels],
    vision: VisionArch,
) -> tuple[list[int], MultiModalInputs]:
    """Each placeholder at `slots` becomes the image's tokens; M-RoPE positions as HF's get_rope_index:
    text continues one position per token, an image's tokens take (start, start + row, start + col) and
    the text after it starts at start + max(rows, cols)."""
    m = vision.spatial_merge_size
    ids: list[int] = []
    images: list[ImageInput] = []
    pos_parts: list[np.ndarray] = []
    prev = 0
    cur = 0
    for slot, (pixels, grid, digest) in zip(slots, processed):
        text = slot - prev
        pos_parts.append(np.broadcast_to(np.arange(cur, cur + text), (3, text)))
        cur += text
        ids.extend(token_ids[prev:slot])
        t, h, w = grid
        gh, gw = h // m, w // m
        n = t * gh * gw
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pos_parts.append(np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cur)
        images.append(ImageInput(len(ids), n, digest, pixels, grid))
        ids.extend([vision.image_token_id] * n)
        cur += max(gh, gw)
        prev = slot + 1
    tail = len(token_ids) - prev
    pos_parts.append(np.broadcast_to(np.arange(cur, cur + tail), (3, tail)))
    ids.extend(token_ids[prev:])
    positions = np.ascontiguousarray(np.concatenate(pos_parts, axis=1), dtype=np.int64)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return ids, MultiModalInputs(tuple(images), positions, delta)


# Image models whose vision towers overnight does not implement yet: their text model runs (the tower's
# tensors are skipped at load) and a prompt with images is refused with this reason (none now).
IMAGES_NOT_YET: dict[str, str] = {}
NO_IMAGES = "this model does not take images"


def no_images_reason(arch: Any) -> str:
    """Why a model without an image processor refuses a prompt with images."""
    return IMAGES_NOT_YET.get(arch.architecture, NO_IMAGES)


def image_processor_for(source: Any, options: Any) -> ImageProcessor | None:
    """The entry points' image processor for a model (None: the model takes no images)."""
    vision = source.arch.vision
    if vision is None:
        return None
    # A checkpoint folder's preprocessor_config.json counts with dummy weights too; a preset has none.
    path = source.path if source.kind in ("hf", "dummy") and os.path.isdir(source.path) else None
    return ImageProcessor(
        vision,
        path,
        MediaPolicy.from_options(options),
        0 if source.arch.text_only else parse_image_limit(options.limit_mm_per_prompt),
        tokenizer_path=source.tokenizer_path,
    )


def split_images(prompt: Any) -> tuple[Any, list[Any]]:
    """(the prompt without multi_modal_data, its images) for vLLM's prompt dict form."""
    if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
        return prompt, []
    data = prompt["multi_modal_data"]
    rest = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
    if not isinstance(data, dict):
        raise InvalidRequestError('multi_modal_data must be a dict such as {"image": image}')
    unknown = set(data) - {"image"}
    if unknown:
        raise InvalidRequestError(f"unsupported multi_modal_data keys {sorted(unknown)} (only image)")
    images = data.get("image")
    if images is None:
        return rest, []
    return rest, list(images) if isinstance(images, (list, tuple)) else [images]
