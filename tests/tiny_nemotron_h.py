"""Tiny random checkpoints of Nemotron-H hybrids (NemotronHForCausalLM): the pattern mixes Mamba2 ("M"),
attention ("*") and MLP ("-") blocks, starting with an MLP block, two B/C groups (so the gated norm's
per-group statistics differ from a whole-width norm), odd sizes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests.tiny_hybrid import save_checkpoint
from tests.tiny_models import _spread_weights

PATTERN = "-M*-MM*M-"
CONFIG: dict[str, Any] = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=24,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    mamba_num_heads=4,
    mamba_head_dim=12,
    n_groups=2,
    ssm_state_size=8,
    conv_kernel=4,
    chunk_size=16,
    layer_norm_epsilon=1e-5,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def make_nemotron_h_model(seed: int = 0, **overrides: Any):
    """The transformers model (fp32, eval)."""
    import transformers

    fields = {**CONFIG, **overrides}
    pattern = fields.pop("hybrid_override_pattern", PATTERN)
    cfg = transformers.NemotronHConfig(hybrid_override_pattern=pattern, **fields)
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(cfg).eval()
    _spread_weights(model, seed)
    return model


def make_nemotron_h_checkpoint(tmp_path: str | os.PathLike, seed: int = 0, **overrides: Any) -> Path:
    return save_checkpoint(make_nemotron_h_model(seed, **overrides), Path(tmp_path) / "tiny-nemotron-h")


# Nemotron 3 (NVIDIA-Nemotron-3-Nano-30B-A3B's shape, shrunk): MoE blocks ("E") among Mamba2, attention
# and an MLP block; 8 ungated relu^2 experts, 2 a token, a shared expert, the published router settings
# (sigmoid scores, one group, renormalized, times 2.5).
MOE_PATTERN = "ME*-EM*E"
MOE_CONFIG: dict[str, Any] = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)


def make_nemotron_h_moe_model(seed: int = 0, **overrides: Any):
    """The transformers model (fp32, eval) with MoE blocks. The routers' e_score_correction_bias (a
    buffer, zero at init) gets values as large as the score gaps, so that choosing by score + bias and
    weighting by the score alone pick other experts than the scores would."""
    fields = {**MOE_CONFIG, "hybrid_override_pattern": MOE_PATTERN, **overrides}
    model = make_nemotron_h_model(seed, **fields)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    return model


def make_nemotron_h_moe_checkpoint(tmp_path: str | os.PathLike, seed: int = 0, **overrides: Any) -> Path:
    return save_checkpoint(make_nemotron_h_moe_model(seed, **overrides), Path(tmp_path) / "tiny-nemotron-3")
