"""Integer weight layouts: each published format unpacked into one canonical form, and that form
dequantized or repacked for the kernel.

Canonical form (IntWeight), for a weight of N output rows and K input columns:

    q      int32 [N, K]    unsigned codes in [0, 2^bits)
    zero   int32 [N, NG]   unsigned zero points (2^(bits-1) when symmetric; GPTQ v1 may give 2^bits)
    scale  float [N, NG]   the checkpoint's dtype, as stored
    g_idx  int32 [K]       group of each input column, or None: column k is in group k // group_size

    weight[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)]

computed in float32 (exact: an integer below 2^9 times a 16-bit float) and rounded once to the target
dtype, which is what compressed-tensors' own decompression gives in the scale's dtype.

Where each format keeps its bits (b = bits, P = 32 / b values per int32, low bits first):

    compressed-tensors  weight_packed [N, K/P], value stored signed, +2^(b-1) in the word; zero points
                        signed, packed along N ([N/P, NG]); unpacked with the package's own helper
    GPTQ                qweight [K/P, N] packed along K; qzeros [NG, N/P] packed along N, v1 holds z - 1
    AWQ                 qweight [K, N/8] packed along N, the 8 nibbles of a word holding columns
                        0, 2, 4, 6, 1, 3, 5, 7 of its 8; qzeros [NG, N/8] the same way; scales [NG, N]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overnight.errors import ModelLoadError

# AWQ's nibble i holds column _AWQ_ORDER[i] of its 8; column j is thus in nibble _AWQ_UNDO[j].
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = tuple(_AWQ_ORDER.index(j) for j in range(8))


@dataclass
class IntWeight:
    q: torch.Tensor
    zero: torch.Tensor
    scale: torch.Tensor
    g_idx: torch.Tensor | None
    group_size: int  # K for one group per row
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def groups(self) -> torch.Tensor:
        """Group of each input column, [K] int64."""
        k = self.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(k, device=self.q.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.groups()
        w = (self.q.float() - self.zero.float()[:, g]) * self.scale.float()[:, g]
        return w.to(dtype)


def unpack_along_last(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., C] -> int32 [..., C * 32/bits]: value j of a word at bits j*bits (low first)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def pack_along_last(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of unpack_along_last (values in [0, 2^bits), last dim a multiple of 32/bits)."""
    per = 32 // bits
    v = values.to(torch.int32).reshape(*values.shape[:-1], values.shape[-1] // per, per)
    shifts = torch.arange(0, 32, bits, device=values.device, dtype=torch.int32)
    fields = v << shifts  # int32: the top field wraps into the sign bit, as the formats store it
    out = fields[..., 0]
    for i in range(1, per):
        out = out | fields[..., i]
    return out


def _check(cond: bool, module: str, what: str) -> None:
    if not cond:
        raise ModelLoadError(f"{module}: {what}")


def _group_size(k: int, groups: int, module: str) -> int:
    _check(groups > 0 and k % groups == 0, module, f"{k} input columns do not split into {groups} groups")
    return k // groups


def _checked_g_idx(g_idx: torch.Tensor | None, k: int, groups: int, module: str) -> torch.Tensor | None:
    """g_idx as int32 [K], or None when it is the plain k // group_size order."""
    if g_idx is None:
        return None
    g = g_idx.to(torch.int32).reshape(-1)
    _check(g.numel() == k, module, f"g_idx has {g.numel()} entries for {k} input columns")
    _check(bool((g >= 0).all()) and bool((g < groups).all()), module, f"g_idx values outside [0, {groups})")
    if torch.equal(g.long(), torch.arange(k, device=g.device) // (k // groups)):
        return None
    return g


def from_compressed_tensors(
    module: str, parts: dict[str, torch.Tensor], bits: int, symmetric: bool
) -> IntWeight:
    """pack-quantized: weight_packed, weight_scale, weight_shape, [weight_zero_point], [weight_g_idx]."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    n, k = (int(v) for v in parts["weight_shape"].reshape(-1).tolist())
    scale = parts["weight_scale"]
    _check(scale.dim() == 2 and scale.shape[0] == n, module, f"weight_scale {list(scale.shape)} for {n} rows")
    groups = int(scale.shape[1])
    offset = 1 << (bits - 1)
    q = unpack_from_int32(parts["weight_packed"], bits, torch.Size([n, k])).to(torch.int32) + offset
    if symmetric or "weight_zero_point" not in parts:
        zero = torch.full((n, groups), offset, dtype=torch.int32, device=q.device)
    else:
        zp = unpack_from_int32(parts["weight_zero_point"], bits, torch.Size([n, groups]), packed_dim=0)
        zero = zp.to(torch.int32) + offset
    group_size = _group_size(k, groups, module)
    g_idx = _checked_g_idx(parts.get("weight_g_idx"), k, groups, module)
    return IntWeight(q, zero, scale, g_idx, group_size, bits)


def from_gptq(module: str, parts: dict[str, torch.Tensor], bits: int, v1: bool) -> IntWeight:
    """qweight [K*b/32, N] packed along K, qzeros [NG, N*b/32], scales [NG, N], optional g_idx [K]."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    q = unpack_along_last(qweight.t(), bits)  # [N, K]
    n, k = q.shape
    _check(scales.dim() == 2 and scales.shape[1] == n, module, f"scales {list(scales.shape)} for {n} columns")
    groups = int(scales.shape[0])
    zero = unpack_along_last(qzeros, bits)[:, :n].t()  # [N, NG]
    _check(zero.shape[1] == groups, module, f"qzeros {list(qzeros.shape)} do not match scales")
    if v1:  # GPTQ v1 stores z - 1, modulo 2^bits (a zero point of 0 comes back as 2^bits)
        zero = zero + 1
    group_size = _group_size(k, groups, module)
    g_idx = _checked_g_idx(parts.get("g_idx"), k, groups, module)
    return IntWeight(q.contiguous(), zero.contiguous(), scales.t().contiguous(), g_idx, group_size, bits)


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    nibbles = unpack_along_last(packed, 4)
    rows, cols = nibbles.shape
    undo = torch.tensor(_AWQ_UNDO, device=packed.device)
    return nibbles.reshape(rows, cols // 8, 8)[:, :, undo].reshape(rows, cols)


def from_awq(module: str, parts: dict[str, torch.Tensor]) -> IntWeight:
    """qweight [K, N/8], qzeros [NG, N/8] (AWQ's column order), scales [NG, N]."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    q = _awq_unpack(qweight).t()  # [N, K]
    n, k = q.shape
    _check(scales.dim() == 2 and scales.shape[1] == n, module, f"scales {list(scales.shape)} for {n} columns")
    groups = int(scales.shape[0])
    zero = _awq_unpack(qzeros).t()
    _check(tuple(zero.shape) == (n, groups), module, f"qzeros {list(qzeros.shape)} do not match scales")
    return IntWeight(
        q.contiguous(), zero.contiguous(), scales.t().contiguous(), None, _group_size(k, groups, module), 4
    )


# -- the kernel's layout -------------------------------------------------------------------------------


def kernel_layout(
    w: IntWeight, module: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(packed int32 [N, K*b/32], scale float32 [N, NG], zero float32 [N, NG], perm int64 [K] or None).

    With a g_idx the input columns are sorted by group (stably) once here, so each group is a run of
    group_size columns as the kernel assumes; the layer then gathers its input's columns by `perm`
    (exllama's and Marlin's way). Rows stay as they are, so fused q/k/v and gate/up tensors stack."""
    n, k = w.shape
    q, perm = w.q, None
    if w.g_idx is not None:
        perm = torch.argsort(w.g_idx.long(), stable=True)
        in_order = torch.arange(k, device=q.device) // w.group_size
        _check(
            torch.equal(w.g_idx.long()[perm], in_order),
            module,
            f"g_idx groups are not all {w.group_size} columns long; not supported",
        )
        q = q[:, perm]
    per = 32 // w.bits
    _check(k % per == 0, module, f"{k} input columns are not a multiple of {per}")
    return pack_along_last(q, w.bits), w.scale.float().contiguous(), w.zero.float().contiguous(), perm
