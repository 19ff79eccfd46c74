"""The tiny routed-MoE checkpoints of the DeepSeek (V2 / V3 / GLM-4.7-Flash), GLM-4.5 and MiniMax-M2
tests: transformers' own model built from a config, saved as an HF folder, and read back as the
fp32 reference; plus the engine settings, the two prompt waves and the token-exact check those tests
(and Llama 4's) run with."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.parity_helpers import hf_greedy
from tests.tiny_models import _spread_weights

# Small pages and chunks so prompts span several of each; the prefix cache on, so a second round hits it.
ENGINE: dict[str, Any] = dict(
    skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16,
    max_num_seqs=4, kv_cache_memory_bytes=1 << 20, enable_prefix_caching=True,
)  # fmt: skip
NEW_TOKENS = 8


def make_moe_checkpoint(
    folder: Path,
    family: str,
    fields: dict[str, Any],
    seed: int = 0,
    edit: Callable[[Any], None] | None = None,
) -> Path:
    """transformers' `{family}ForCausalLM` of `{family}Config(**fields)` saved in folder: its random
    weights spread as the other tiny models' (tests/tiny_models.py), each router's
    e_score_correction_bias drawn (transformers initializes it to zeros, which would leave the bias
    out of every expert choice), then `edit(model)` for a test's own changes."""
    import transformers

    config = getattr(transformers, f"{family}Config")(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    _spread_weights(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=gen))
        if edit is not None:
            edit(model)
    model.save_pretrained(folder)
    return folder


def load_moe_reference(folder: Path, family: str) -> Any:
    """The saved checkpoint as transformers' fp32 model with eager attention."""
    import transformers

    cls = getattr(transformers, f"{family}ForCausalLM")
    return cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def waves(high: int, first: int = 29, last: int = 12) -> tuple[list[list[int]], list[list[int]]]:
    """Two rounds of prompts of ids in [3, high) sharing a 21-token prefix, the second hitting the
    prefix cache; the first round opens with a `first`-token prompt, the second ends with a `last`-token
    one (both without the prefix)."""
    rng = random.Random(0)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, high) for _ in range(n)]

    prefix = toks(21)
    return [toks(first), prefix + toks(5), toks(3)], [prefix + toks(9), prefix + toks(2), toks(last)]


def check_waves_token_exact(llm: Any, ref: Any, rounds: tuple[list[list[int]], list[list[int]]]) -> None:
    """The two rounds through llm.generate (greedy, NEW_TOKENS each): the second hits the prefix cache
    (20+ tokens for each of its two prefix prompts), every prompt's tokens equal transformers' greedy
    ones, and the outputs vary (more than 15 distinct tokens: a mixed-up batch would show)."""
    from overnight import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    first, second = rounds
    outs = llm.generate(first, params, use_tqdm=False)
    hits = llm.engine.stats().prefix_cache_hits
    outs += llm.generate(second, params, use_tqdm=False)
    assert llm.engine.stats().prefix_cache_hits - hits >= 2 * 20
    distinct = set()
    for prompt, out in zip(first + second, outs):
        tokens = list(out.outputs[0].token_ids)
        assert tokens == hf_greedy(ref, prompt, NEW_TOKENS)[0], f"prompt of {len(prompt)} tokens"
        distinct.update(tokens)
    assert len(distinct) > 15
