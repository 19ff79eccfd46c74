"""The tiny routed-MoE checkpoints of the DeepSeek (V2 / V3 / GLM-4.7-Flash), GLM-4.5 and MiniMax-M2
tests: transformers' own model built from a config, saved as an HF folder, and read back as the
fp32 reference; plus the engine settings those tests run with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

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
