"""Rotary position embedding, with the RoPE scalings of HF configs and partial / interleaved rotation.

The cos/sin table is computed once for every position up to max_position, over the rotated part of a
head only (rotary_dim <= head_dim dims, R = rotary_dim / 2 frequencies):

    cos_sin_cache[max_position, rotary_dim]  =  [ a cos(p f_0 .. p f_{R-1}) | a sin(same) ]

and looked up by each token's absolute position, so a step may mix tokens of any positions. Every
scaling lives in this table: its frequencies f (linear, dynamic, YaRN, LongRoPE, llama3) and its
attention factor a (YaRN's mscale, LongRoPE's), which HF multiplies into cos and sin.

Which elements of a head rotate together (the pair (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)):

    rotate-half (Llama and most):   i  with  i + R           for i < R
    interleaved (GLM-4):           2i  with  2i + 1          for i < R
    and dims rotary_dim .. head_dim pass through unrotated (partial rotary: Phi-3/4-mini, GLM-4).

Scalings whose HF frequencies depend on the length of the sequence are fixed per position here, the only
form a paged cache can hold (a cached key keeps the rotation it was written with):
  - dynamic (NTK): HF changes the base only once a sequence grows past max_position_embeddings, which the
    engine never lets a sequence do (build.py caps max_model_len there): the table is the plain one.
  - longrope: HF's rotary module uses the short factors while the sequence is within
    original_max_position_embeddings and the long ones beyond, and Phi-3's generate() recomputes the whole
    cache with the long factors when a sequence first crosses that length. Here position p uses the
    short factors when p < original_max_position_embeddings, the long ones from there (vLLM makes a
    per-position choice too): identical to HF for sequences that stay within the original context, and to
    HF's model run over a cache with prompts within it and one token a step past it; a sequence that
    grows past it differs from HF's generate() in the rotation of its first original_max_position_embeddings
    keys (for Phi-3/4-mini, 4096 tokens).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import cast

import torch
from torch import nn

from overnight.kernels.dispatch import use_kernels
from overnight.layers.norm import RMSNorm

# A scaling's parameters, HF's rope_parameters less rope_theta: floats, lists (LongRoPE's factors) and
# the "rope_type" name. Without "rope_type", a dict of llama3's four keys is llama3 (older callers).
RopeScaling = Mapping[str, "float | str | bool | tuple[float, ...] | list[float]"]
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def rope_type_of(scaling: RopeScaling | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "llama3")))


def _inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 long-context scaling: low frequencies (wavelength beyond the original context divided
    by low_freq_factor) are slowed by `factor`, high ones kept, and the band between interpolated."""
    factor = _num(scaling, "factor")
    low_freq_factor = _num(scaling, "low_freq_factor")
    high_freq_factor = _num(scaling, "high_freq_factor")
    old_context_len = _num(scaling, "original_max_position_embeddings")
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _get(scaling: RopeScaling, key: str, default: float | None = None) -> float | None:
    value = scaling.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)):
        raise ValueError(f"RoPE parameter {key} must be a number, got {value!r}")
    return float(value)


def _num(scaling: RopeScaling, key: str) -> float:
    value = _get(scaling, key)
    if value is None:
        raise ValueError(f"RoPE scaling {rope_type_of(scaling)} needs {key}")
    return value


def _factors(scaling: RopeScaling, key: str) -> list[float]:
    value = scaling.get(key)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"RoPE parameter {key} must be a list of numbers, got {value!r}")
    return [float(x) for x in value]


def _yarn(dim: int, theta: float, scaling: RopeScaling, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies blend from interpolated (divided by factor) for the slow dims to extrapolated
    (kept) for the fast ones, over a linear ramp between the dims that turn beta_slow and beta_fast times
    within the original context; attention factor 0.1 ln(factor) + 1 (or mscale / mscale_all_dim's)."""
    original = _num(scaling, "original_max_position_embeddings")
    factor = _get(scaling, "factor") or max_position / original
    attention_factor = _get(scaling, "attention_factor")
    mscale, mscale_all_dim = _get(scaling, "mscale"), _get(scaling, "mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = _get(scaling, "beta_fast") or 32.0
    beta_slow = _get(scaling, "beta_slow") or 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(
    dim: int, theta: float, scaling: RopeScaling, max_position: int
) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """LongRoPE (Phi-3/4): per-frequency divisors, short_factor within the original context and
    long_factor beyond; attention factor sqrt(1 + ln(factor) / ln(original)).
    Returns (short inv_freq, long inv_freq, original context, attention factor)."""
    original = int(_num(scaling, "original_max_position_embeddings"))
    factor = _get(scaling, "factor") or max_position / original
    attention_factor = _get(scaling, "attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    out = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(_factors(scaling, key), dtype=torch.float32)
        if ext.shape != (dim // 2,):
            raise ValueError(f"longrope {key} must have {dim // 2} entries, got {ext.numel()}")
        out.append(1.0 / (ext * theta**shape))
    return out[0], out[1], original, float(attention_factor)


def rope_table(
    rotary_dim: int,
    max_position: int,
    theta: float,
    scaling: RopeScaling | None = None,
    table_positions: int | None = None,
) -> torch.Tensor:
    """[table_positions, rotary_dim] float32 on the CPU: the cos | sin halves of every position (module
    doc). max_position: the model's context (YaRN's and LongRoPE's default factor is max_position /
    original); table_positions (default max_position): the positions the table covers."""
    kind = rope_type_of(scaling)
    positions = torch.arange(
        max_position if table_positions is None else table_positions, dtype=torch.float32
    )
    attention_factor = 1.0
    if kind == "longrope":
        assert scaling is not None
        short, long, original, attention_factor = _longrope(rotary_dim, theta, scaling, max_position)
        freqs = torch.cat((torch.outer(positions[:original], short), torch.outer(positions[original:], long)))
    else:
        inv_freq = _inv_freq(rotary_dim, theta)
        if kind == "llama3":
            assert scaling is not None
            inv_freq = _llama3_scale(inv_freq, scaling)
        elif kind == "linear":
            assert scaling is not None
            inv_freq = inv_freq / _num(scaling, "factor")
        elif kind == "yarn":
            assert scaling is not None
            inv_freq, attention_factor = _yarn(rotary_dim, theta, scaling, max_position)
        elif kind not in ("default", "dynamic"):  # dynamic: plain within max_position (module doc)
            raise ValueError(f"unsupported RoPE type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
        freqs = torch.outer(positions, inv_freq)
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return table * attention_factor if attention_factor != 1.0 else table


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] fp32: cos | sin (a buffer, never saved)

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        rope_scaling: RopeScaling | None = None,
        *,
        rotary_dim: int | None = None,
        interleaved: bool = False,
        table_positions: int | None = None,
    ) -> None:
        """table_positions: the positions the table covers (the engine's max_model_len when it is
        shorter than max_position: Llama 4's configs say 10M positions, 5 GB of float32 table)."""
        super().__init__()
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(
                f"rotary_dim must be even and in 2..head_dim ({head_dim}), got {self.rotary_dim}"
            )
        self.head_dim = head_dim
        self.max_position = max_position
        self.table_positions = table_positions or max_position
        self.theta = theta
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        self.interleaved = interleaved
        self.register_buffer("cos_sin_cache", self._table(torch.get_default_device()), persistent=False)

    def _table(self, device: torch.device) -> torch.Tensor:
        if device.type == "meta":
            return torch.empty(self.table_positions, self.rotary_dim, dtype=torch.float32, device=device)
        # Computed on the CPU in fp32 whatever the target, so every device gets the same numbers; kept in
        # fp32 and cast to q's dtype on use.
        with torch.device("cpu"):
            table = rope_table(
                self.rotary_dim, self.max_position, self.theta, self.rope_scaling, self.table_positions
            )
        return table.to(device)

    def reset_table(self) -> None:
        """Recompute the table where it now lives (after a meta-built model is materialized)."""
        self.cos_sin_cache = self._table(self.cos_sin_cache.device)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64; q: [T, H, D]; k: [T, Hkv, D]. Returns the rotated q and k; with q_norm
        and k_norm (Qwen3), each head of q and k is RMS-normalized first.

        The kernel path (use_kernels) rotates q and k in place, norms included, in one launch (with
        q_norm's eps for both: Qwen3's two norms share one), and returns them; the PyTorch path returns
        new tensors and leaves q and k as they were."""
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm come together")
        if use_kernels(q):
            from overnight.kernels.rotary import qk_norm_rotary_inplace, rotary_inplace  # triton on use

            if q_norm is not None and k_norm is not None and self.rotary_dim != self.head_dim:
                # The fused norm + rotation takes whole-head rotations only; with partial RoPE
                # (GLM-4.5's q/k norms) the norms run first, as two more launches.
                q, k = cast(torch.Tensor, q_norm(q)), cast(torch.Tensor, k_norm(k))
                rotary_inplace(positions, q, k, self.cos_sin_cache, interleaved=self.interleaved)
            elif q_norm is None or k_norm is None:
                rotary_inplace(positions, q, k, self.cos_sin_cache, interleaved=self.interleaved)
            else:
                eps = q_norm.variance_epsilon
                qk_norm_rotary_inplace(
                    positions,
                    q,
                    k,
                    self.cos_sin_cache,
                    q_norm.weight,
                    k_norm.weight,
                    eps,
                    interleaved=self.interleaved,
                )
            return q, k
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return rotary_ref(positions, q, k, self.cos_sin_cache, self.interleaved)

    def extra_repr(self) -> str:
        extra = f", rotary_dim={self.rotary_dim}" if self.rotary_dim != self.head_dim else ""
        extra += ", interleaved" if self.interleaved else ""
        return f"head_dim={self.head_dim}, max_position={self.max_position}{extra}"


def rotary_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch path: rotated copies of q [T, H, D] and k [T, Hkv, D] (the first cos_sin_cache.shape[1]
    dims of each head rotate, the rest pass); the table's cos/sin are cast to each one's dtype before use,
    as the HF reference does."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, R] each
    return (
        rotate(q, cos.to(q.dtype), sin.to(q.dtype), interleaved),
        rotate(k, cos.to(k.dtype), sin.to(k.dtype), interleaved),
    )


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [..., D] with its first 2R dims rotated by cos / sin [..., R] (either pair layout), the rest
    passed through (also M-RoPE's per-token angles, layers/mrope.py)."""
    rotary_dim = 2 * cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:  # pairs (2i, 2i + 1)
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:  # pairs (i, i + R): the rotate-half layout of HF checkpoints
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if rotary_dim == x.shape[-1] else torch.cat((out, rest), dim=-1)
