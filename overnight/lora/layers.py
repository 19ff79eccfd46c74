"""LoRA applied from outside the model, as quant/apply.py applies FP8: each adaptable linear layer of
every decoder layer is wrapped by a LoRALinear holding one zeroed A/B stack per device slot.

    LoRALinear(base)       y = base(x); y += expand(shrink(x, A), B) by each row's slot
      lora_a [max_loras, n, R, in]      n output slices (qkv_proj: q, k, v; gate_up_proj: gate, up)
      lora_b [max_loras, out, R]        slice s owns rows offsets[s]:offsets[s + 1] of `out`
    LoRABatch              the step's row -> slot map in static device buffers, shared by the layers

The buffers are allocated once at max_lora_rank and never replaced: decode CUDA graphs capture their
addresses, and a new adapter is a copy into a slot (slots.py). Rows of the base model have slot -1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.kernels.dispatch import use_kernels
from overnight.kernels.lora import (
    BLOCK_M,
    PREFILL_BLOCK_M,
    SlotRows,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
    max_tiles,
    tile_table,
)
from overnight.lora.targets import layer_modules


def _aligned(n: int) -> int:
    return -(-n // 4) * 4  # int32 elements in a whole number of 16 bytes


class LoRABatch:
    """Row -> slot of the step being run, in static device buffers. map_rows() fills it before each
    forward pass: token_slots (every row; -1 for base and padding rows: the torch path's map) and rows
    (SlotRows: the adapter rows grouped by slot in tiles, what the kernels read). A step without
    adapter rows skips LoRA (active False), except while decode graphs are captured: the captured
    kernels read the table at every replay, and a step without adapter rows leaves every tile empty."""

    def __init__(self, max_tokens: int, max_slots: int, device: torch.device) -> None:
        self.device = device
        self.max_tokens = max_tokens
        self.max_slots = max_slots
        cuda = device.type == "cuda"
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.order = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        # The tile table's rows (slot, start, length) each at a multiple of 16 bytes: Triton
        # specializes the row stride on that.
        self._width = _aligned(max_tiles(max_tokens, max_slots))
        self.tiles = torch.zeros(3, self._width, dtype=torch.int32, device=device)
        # Host staging [token_slots | order | tiles], pinned and double-buffered on CUDA (a copy may
        # still be in flight): contiguous copies (a strided one from host memory would be staged
        # through pageable memory, waiting for the GPU).
        self._hosts = [
            torch.full((2 * max_tokens + 3 * self._width,), -1, dtype=torch.int32, pin_memory=cuda)
            for _ in range(2 if cuda else 1)
        ]
        self._events: list[torch.cuda.Event | None] = [None] * len(self._hosts)
        self._turn = 0
        self.rows = SlotRows(self.order, self.tiles, None)
        self.active = False
        self._dirty = True  # the buffers may hold a step's tiles (a graph replay would read them)

    def map_rows(
        self, req_slots: Sequence[int], lens: Sequence[int], num_rows: int, decode_only: bool
    ) -> None:
        """req_slots[i] is the slot of the i-th scheduled request (rows in request order, lens[i] rows
        each; -1: the base model); num_rows counts padding rows too (a graph's bucket)."""
        slots = np.asarray(req_slots, dtype=np.int32)
        self.active = bool((slots >= 0).any())
        if not self.active:
            if self._dirty:  # a decode graph runs the kernels whatever `active` says: no tiles
                self.token_slots.fill_(-1)
                self.tiles.zero_()
                self._dirty = False
            return
        self._dirty = True
        counts = np.asarray(lens, dtype=np.int64)
        num_tokens = int(counts.sum())
        turn = self._turn
        self._turn = (turn + 1) % len(self._hosts)
        event = self._events[turn]
        if event is not None:
            event.synchronize()
        host_t = self._hosts[turn]
        host = host_t.numpy()
        t = self.max_tokens
        row_slots = host[:num_rows]
        row_slots[:num_tokens] = slots if decode_only else np.repeat(slots, counts)
        row_slots[num_tokens:] = -1
        adapted = np.flatnonzero(row_slots[:num_tokens] >= 0)
        by_slot = row_slots[adapted]
        order = adapted[np.argsort(by_slot, kind="stable")]
        per_slot = np.bincount(by_slot, minlength=self.max_slots)
        host[t : t + len(order)] = order
        # decode: the bucket's tile count, as its graph was captured (empty tiles pad the table)
        block_m = BLOCK_M if decode_only else PREFILL_BLOCK_M
        table = tile_table(per_slot, self._width, block_m)
        host[2 * t :].reshape(3, self._width)[:] = table
        cuda = self.device.type == "cuda"
        self.token_slots[:num_rows].copy_(host_t[:num_rows], non_blocking=cuda)
        self.order[: len(order)].copy_(host_t[t : t + len(order)], non_blocking=cuda)
        self.tiles.view(-1).copy_(host_t[2 * t :], non_blocking=cuda)
        num_tiles = None if decode_only else int((table[2] > 0).sum())
        self.rows = SlotRows(self.order, self.tiles, num_tiles, block_m)
        if cuda:
            ev = torch.cuda.Event()
            ev.record()
            self._events[turn] = ev

    def for_capture(self) -> None:
        """Decode graphs record the kernels with every tile empty (all rows of the base model) until a
        replay's table; their grid is the bucket's max_tiles."""
        self.token_slots.fill_(-1)
        self.tiles.zero_()
        self.rows = SlotRows(self.order, self.tiles, None)
        self.active = True
        self._dirty = False


class LoRALinear(nn.Module):
    """A linear layer (nn.Linear or Fp8Linear) plus the LoRA of whichever adapter each row's slot holds."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    offsets_dev: torch.Tensor

    def __init__(
        self,
        base: nn.Module,
        batch: LoRABatch,
        slice_sizes: Sequence[int],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        # Every wrapped layer (nn.Linear, Fp8Linear, the tensor-parallel ones) holds weight [out, in].
        weight = base.get_parameter("weight")
        out_features, in_features = weight.shape
        self.in_features, self.out_features = in_features, out_features
        # A row-parallel layer's partial x @ A^T is summed over the ranks before the expand.
        self.reduce: Callable[[torch.Tensor], object] | None = None
        if sum(slice_sizes) != out_features:
            raise ValueError(f"LoRA slices {list(slice_sizes)} do not add up to {out_features} outputs")
        device = next(base.parameters()).device
        n = len(slice_sizes)
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, n, max_rank, in_features, dtype=dtype, device=device)
        )
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device)
        )
        offsets = [0]
        for size in slice_sizes:
            offsets.append(offsets[-1] + size)
        self.offsets = tuple(offsets)
        self.max_slice = max(slice_sizes)
        self.register_buffer("offsets_dev", torch.tensor(offsets, dtype=torch.int32, device=device))

    def set_slot(self, slot: int, parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` holds these (slice, A [r, in], B [out_s, r]) and zeros elsewhere."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for s, a, b in parts:
            r = a.shape[0]
            self.lora_a[slot, s, :r].copy_(a)
            self.lora_b[slot, self.offsets[s] : self.offsets[s + 1], :r].copy_(b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.batch
        if not batch.active:
            return y
        kernels = use_kernels(x)
        h = (
            lora_shrink(x, self.lora_a, batch.rows, zero_base_rows=self.reduce is not None)
            if kernels
            else lora_shrink_ref(x, self.lora_a, batch.token_slots)
        )
        if self.reduce is not None:
            self.reduce(h)
        if kernels:
            lora_expand(y, h, self.lora_b, self.offsets_dev, self.max_slice, batch.rows)
        else:
            lora_expand_ref(y, h, self.lora_b, batch.token_slots, self.offsets)
        return y


def apply_lora(
    model: nn.Module, arch: ModelArch, batch: LoRABatch, max_loras: int, max_rank: int, dtype: torch.dtype
) -> dict[tuple[int, str], LoRALinear]:
    """Wrap every projection of every decoder layer that the family's adapters may target
    (targets.layer_modules; a sparse layer's experts are not linear layers and stay as they are, a
    hybrid's layer has attention or a mixer) and return them by (layer, module path)."""
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    layers = model.get_submodule("model.layers")
    layer: nn.Module
    for i, layer in enumerate(layers.children()):
        for path, sizes in layer_modules(arch, i).items():
            try:
                base = layer.get_submodule(path)
            except AttributeError:
                continue
            if not isinstance(getattr(base, "weight", None), torch.Tensor):
                continue  # not a linear layer (a sparse layer's experts)
            if isinstance(base, LoRALinear):
                continue
            module = LoRALinear(base, batch, sizes, max_loras, max_rank, dtype)
            parent, _, leaf = path.rpartition(".")
            setattr(layer.get_submodule(parent), leaf, module)
            wrapped[(i, path)] = module
    # A producer that quantizes its output for an FP8 layer (quant/apply.py) must hand over plain
    # tensors now: the LoRA reads the unquantized input, and the FP8 layer quantizes it itself.
    for m in model.modules():
        if getattr(m, "fp8_output", False):
            m.fp8_output = False  # type: ignore[assignment]
    return wrapped
