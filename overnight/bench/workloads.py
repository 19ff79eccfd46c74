"""Benchmark workloads: the same token ids (and images) every engine is given (see the peers' measurements).

Text workloads: for each request, with Python's random.Random(seed): n_in = randint(in_lo, in_hi), then
n_out = randint(out_lo, out_hi), then n_in ids drawn with randrange(100, vocab - 1000). With
shared_prefix, the same rng first draws that many ids, which every prompt starts with (a system prompt:
the prefix cache's case); n_in then counts the ids after it.

Image workloads (image_size set: captioning): each request is the fixed caption prompt of caption.py with
one synthetic image of image_size, drawn from (seed, request index); n_out = randint(out_lo, out_hi) with
random.Random(seed). Their prompts need the model (its image token ids), so they come from prompts(arch).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from overnight.arch import ModelArch

Prompt = dict[
    str, Any
]  # {"prompt_token_ids": ids[, "multi_modal_data": {"image": image}]}, as LLM.generate takes


@dataclass(frozen=True)
class Workload:
    name: str
    model: str  # dummy preset
    num_requests: int
    input_len: tuple[int, int]  # text workloads; (0, 0) for an image workload (its prompt is caption.py's)
    output_len: tuple[int, int]
    seed: int = 0
    image_size: tuple[int, int] | None = None  # (width, height): one synthetic image per request
    shared_prefix: int = 0  # ids every prompt starts with (text workloads)

    def requests(self, vocab_size: int) -> list[tuple[list[int], int]]:
        """[(prompt token ids, output length)] in submission order (text workloads)."""
        if self.image_size is not None:
            raise ValueError(f"{self.name} is an image workload: its prompts come from prompts(arch)")
        rng = random.Random(self.seed)
        prefix = [rng.randrange(100, vocab_size - 1000) for _ in range(self.shared_prefix)]
        out = []
        for _ in range(self.num_requests):
            n_in = rng.randint(*self.input_len)
            n_out = rng.randint(*self.output_len)
            out.append((prefix + [rng.randrange(100, vocab_size - 1000) for _ in range(n_in)], n_out))
        return out

    def prompts(self, arch: ModelArch) -> list[tuple[Prompt, int]]:
        """[(prompt, output length)] in submission order, in the form both engines' LLM.generate take.
        Raises ValueError when an image workload does not fit the model (caption.py)."""
        if self.image_size is None:
            return [({"prompt_token_ids": ids}, n) for ids, n in self.requests(arch.vocab_size)]
        from overnight.bench.caption import caption_prompt_ids, synthetic_image

        ids = caption_prompt_ids(arch)
        width, height = self.image_size
        rng = random.Random(self.seed)
        out = []
        for i in range(self.num_requests):
            image = synthetic_image(width, height, self.seed, i)
            out.append(
                (
                    {"prompt_token_ids": list(ids), "multi_modal_data": {"image": image}},
                    rng.randint(*self.output_len),
                )
            )
        return out

    def warmup_prompts(self, arch: ModelArch, n: int = 8) -> list[Prompt]:
        """n prompts for a warm-up before the timed run: a text workload's first ones; for an image
        workload other images (the next seed), so no timed image is already in an engine's caches."""
        seed = self.seed if self.image_size is None else self.seed + 1
        return [p for p, _ in replace(self, num_requests=n, seed=seed).prompts(arch)]

    def describe(self) -> str:
        if self.image_size is not None:
            w, h = self.image_size
            return f"{self.num_requests} requests, one {w}x{h} image each (caption prompt), output {self.output_len}"
        shared = f"{self.shared_prefix} shared + " if self.shared_prefix else ""
        return f"{self.num_requests} requests, input {shared}{self.input_len}, output {self.output_len}"


WORKLOADS = {
    w.name: w
    for w in [
        Workload("seed-512-256", "qwen3-8b", 1024, (512, 512), (256, 256)),
        Workload("nano-256", "qwen3-0.6b", 256, (100, 1024), (100, 1024)),
        Workload("long-1024-1024", "qwen3-8b", 512, (1024, 1024), (1024, 1024)),
        # seed-512-256 behind one 2,000-token system prompt: each request computes 512 of its 2,512
        # prompt tokens once the prefix is cached (the hybrids keep a state per cached prefix).
        Workload("prefix-2000-512-256", "qwen3-8b", 1024, (512, 512), (256, 256), shared_prefix=2000),
        # The CPU check: the embedded default model, mixed lengths (continuous batching's home ground).
        Workload("cpu-64", "default", 64, (16, 192), (8, 96)),
        # Captioning: 448 px is a multiple of both towers' merged patch (28 and 32 px), so no resize: 256
        # image tokens per request on Qwen2.5-VL (and Qwen2-VL: --model qwen2-vl-7b), 196 on Qwen3-VL
        # (--model qwen3-vl-8b).
        Workload("caption-448", "qwen2.5-vl-7b", 1024, (0, 0), (128, 128), image_size=(448, 448)),
    ]
}


def custom(
    num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0
) -> Workload:
    return Workload("custom", "", num_requests, input_len, output_len, seed)


# Output positions where output_spread counts distinct tokens: early, middle and late in the longest
# workload's 1,024 outputs.
SPREAD_POSITIONS = (0, 255, 511, 1023)


def output_spread(tokens: list[list[int]], positions: tuple[int, ...] = SPREAD_POSITIONS) -> dict[str, int]:
    """How many distinct tokens the requests emitted at each of `positions` (requests whose output
    reaches it), keyed by position as a string for JSON; positions no request reaches are left out.

    On dummy weights the work a step does depends on the tokens the model happens to emit: each engine
    draws its own random weights, a greedy model's outputs may collapse onto a few tokens, and a
    mixture of experts routes every copy of a token to the same experts, so a step of few distinct
    tokens reads few experts' weights. Both engines' benches report this beside their throughput, so a
    pair's rows say whether they did the same work."""
    spread: dict[str, int] = {}
    for p in positions:
        seen = {t[p] for t in tokens if len(t) > p}
        if seen:
            spread[str(p)] = len(seen)
    return spread
