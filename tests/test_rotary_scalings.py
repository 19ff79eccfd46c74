"""RoPE beyond plain and llama3: each scaling's table against transformers' rope init functions and its
rotary modules (linear, dynamic, YaRN, LongRoPE), partial and interleaved rotation against HF's
apply_rotary_pos_emb, and the Triton kernel on partial / interleaved tables against rotary_ref (through
the interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from overnight.kernels.rotary import qk_norm_rotary_inplace, rotary_inplace
from overnight.layers.rotary import RotaryEmbedding, rope_table, rotary_ref
from tests.test_kernels_small_ops import DEVICE, DTYPES, assert_matches, qkv_views

MAX_POS = 96
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 24, "beta_fast": 16.0},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 16,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 32,
        "short_factor": [1.0 + 0.1 * i for i in range(6)],
        "long_factor": [2.0 + 0.5 * i for i in range(6)],
    },
}


def _hf_cos_sin(scaling: dict, rotary_dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim] of transformers' Llama rotary module for this scaling (HF LongRoPE picks its
    factors by the length of the whole call, so positions go one at a time as in decoding)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim = 16
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=MAX_POS,
        rope_parameters={"rope_theta": 5000.0, "partial_rotary_factor": rotary_dim / head_dim, **scaling},
    )
    rope = LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, 1, head_dim)
    rows = [rope(x, p.view(1, 1)) for p in positions]
    return torch.cat([c[0] for c, _ in rows]), torch.cat([s[0] for _, s in rows])


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_scaled_tables_match_transformers(name: str) -> None:
    rotary_dim = 12  # a partial rotation of 16-dim heads: the frequencies use rotary_dim
    positions = torch.tensor([0, 1, 5, 15, 16, 23, 24, 31, 32, 33, 60, 95])
    cos, sin = _hf_cos_sin(SCALINGS[name], rotary_dim, positions)
    table = rope_table(rotary_dim, MAX_POS, 5000.0, SCALINGS[name])[positions]
    half = rotary_dim // 2
    assert torch.equal(table[:, :half], cos[:, :half]) and torch.equal(table[:, half:], sin[:, :half])


def test_partial_and_interleaved_rotation_match_transformers() -> None:
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb as glm4_apply
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 4, 16, generator=gen), torch.randn(7, 2, 16, generator=gen)
    positions = torch.tensor([0, 3, 9, 31, 32, 50, 95])
    for interleaved, apply in ((False, phi3_apply), (True, glm4_apply)):
        rope = RotaryEmbedding(16, MAX_POS, 5000.0, rotary_dim=8, interleaved=interleaved)
        cos, sin = rope.cos_sin_cache[positions].chunk(2, dim=-1)
        cos, sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
        q_ref, k_ref = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        q_out, k_out = rope(positions, q, k)
        assert torch.equal(q_out, q_ref[0].transpose(0, 1)) and torch.equal(k_out, k_ref[0].transpose(0, 1))
        assert torch.equal(q_out[..., 8:], q[..., 8:])  # the unrotated part passes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim,interleaved", [(8, False), (12, True), (24, True)])
def test_kernel_partial_and_interleaved(dtype: torch.dtype, rotary_dim: int, interleaved: bool) -> None:
    hq, hkv, d = 3, 1, 24
    rope = RotaryEmbedding(
        d, 300, 10000.0, SCALINGS["yarn"], rotary_dim=rotary_dim, interleaved=interleaved
    ).to(DEVICE)
    positions = torch.tensor([0, 1, 7, 299, 64, 3, 3, 150, 42], device=DEVICE)
    qkv, q, k = qkv_views(9, hq, hkv, d, dtype, seed=3)
    before = qkv.clone()
    ref_q, ref_k = rotary_ref(positions, q, k, rope.cos_sin_cache, interleaved)
    rotary_inplace(positions, q, k, rope.cos_sin_cache, interleaved=interleaved)
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    assert torch.equal(qkv[:, (hq + hkv) * d :], before[:, (hq + hkv) * d :])  # v untouched


def test_kernel_refuses_a_norm_with_partial_rotation() -> None:
    rope = RotaryEmbedding(16, 64, 10000.0, rotary_dim=8).to(DEVICE)
    _, q, k = qkv_views(2, 2, 1, 16, torch.float32, seed=1)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="full rotation"):
        qk_norm_rotary_inplace(
            torch.zeros(2, dtype=torch.long, device=DEVICE), q, k, rope.cos_sin_cache, w, w, 1e-6
        )


def test_bad_rotary_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(16, 64, 10000.0, rotary_dim=7)
    with pytest.raises(ValueError, match="unsupported RoPE type"):
        rope_table(16, 64, 10000.0, {"rope_type": "mrope"})
    with pytest.raises(ValueError, match="short_factor"):
        rope_table(16, 64, 10000.0, {**SCALINGS["longrope"], "short_factor": [1.0]})
