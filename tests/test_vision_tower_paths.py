"""The Qwen towers' fast paths against the tower as built (plain PyTorch): the fused, padded SwiGLU that
loading leaves (SwiGLU.after_load_), and the kernels for the patches' RMSNorm and 2-D RoPE (the rotary
kernel's fp32 mode). The parity with transformers is tests/test_vision_parity.py; this file pins the
pieces. Without a GPU, conftest.py turns on the Triton interpreter (fp32/fp16 only)."""

from __future__ import annotations

import json

import pytest
import torch

from overnight.kernels import dispatch
from overnight.kernels.rotary import rotary_inplace
from overnight.models.interface import finish_loading
from overnight.models.registry import arch_from_hf_config
from overnight.models.vision.qwen_vit import (
    WIDTH_MULTIPLE,
    PatchRope,
    SwiGLU,
    build_vision_tower,
    rotary_angles,
    rotate_qk,
)
from tests.kernel_helpers import DEVICE
from tests.tiny_vl import make_vl_checkpoint

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    folder = make_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl")
    with open(f"{folder}/config.json") as f:
        arch = arch_from_hf_config(json.load(f))
    assert arch.vision is not None and arch.vision.intermediate_size % WIDTH_MULTIPLE != 0
    return arch.vision


def random_tower(v, seed: int = 0) -> torch.nn.Module:
    tower = build_vision_tower(v).to(DEVICE)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return tower.eval()


def pixels(v, grid: list[tuple[int, int, int]], seed: int = 1) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grid)
    width = v.in_channels * v.temporal_patch_size * v.patch_size**2
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def test_after_load_fuses_and_pads_the_mlp_exactly(vision):
    mlp = random_tower(vision).blocks[0].mlp
    assert isinstance(mlp, SwiGLU)
    x = torch.randn(37, vision.hidden_size, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        built = mlp(x)
        finish_loading(mlp)
        finish_loading(mlp)  # a second call changes nothing
        fused = mlp(x)
    width = vision.intermediate_size + (-vision.intermediate_size % WIDTH_MULTIPLE)
    assert mlp.gate_up is not None and mlp.gate_up.weight.shape == (2 * width, vision.hidden_size)
    assert mlp.down_proj.weight.shape == (vision.hidden_size, width) and mlp.down_proj.weight.is_contiguous()
    assert not hasattr(mlp, "gate_proj") and not hasattr(mlp, "up_proj")
    assert mlp.gate_up.bias is not None and mlp.gate_up.bias[vision.intermediate_size : width].eq(0).all()
    torch.testing.assert_close(fused, built, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_rotary_kernel_equals_the_tower_reference(vision, dtype: torch.dtype, monkeypatch) -> None:
    grid = [(1, 4, 6), (1, 2, 2)]
    rope = PatchRope.of(rotary_angles(vision, grid, torch.device(DEVICE)))
    n, heads = rope.positions.shape[0], vision.num_heads
    head_dim = vision.hidden_size // heads
    qkv = torch.randn(n, 3, heads, head_dim, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    q, k, _ = qkv.unbind(1)  # strided views, as the tower's fused qkv gives them
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    ref_q, ref_k = rotate_qk(q, k, rope)  # new tensors: q and k are left as they are
    before = q.clone()
    rotary_inplace(rope.positions, q, k, rope.cos_sin, wide=True)
    assert not torch.equal(q, before)  # rotated in place, in the qkv buffer
    # fp32 throughout and one rounding at the end in both, no fma (COMPILE_OPTIONS): equal
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


def test_tower_with_kernels_matches_the_built_tower(vision, monkeypatch):
    """The whole tower (windows, full-attention block, merger): as built in PyTorch, against loaded
    (fused, padded MLP) with every kernel on."""
    grid = [(1, 8, 12), (1, 4, 4)]
    x = pixels(vision, grid)
    tower = random_tower(vision)
    with torch.no_grad():
        monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
        built = tower(x, grid).embeds
        finish_loading(tower)
        monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
        fast = tower(x, grid).embeds
    assert fast.shape == built.shape == (sum(h * w for _, h, w in grid) // 4, vision.out_hidden_size)
    torch.testing.assert_close(fast, built, rtol=1e-4, atol=1e-4)
