"""The batched LoRA kernels (shrink / expand over rows grouped by slot) against their torch references,
on mixed-slot batches with base rows (-1), padded ranks and fused slices of unequal sizes, as prefill
and as decode (a graph's grid over every row); and LoRABatch's grouping. Without a GPU they run
through the Triton interpreter (conftest.py): tiny shapes, fp32 / fp16."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from overnight.kernels.lora import (
    BLOCK_M,
    PREFILL_BLOCK_M,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
    max_tiles,
    shrink_splits,
    slot_rows_ref,
    tile_table,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def setup(dtype: torch.dtype, seed: int, lens: list[int], seg_slots: list[int], rank: int = 8):
    gen = torch.Generator().manual_seed(seed)
    slots_n, k = 3, 40
    slices = (24, 8, 8)  # q/k/v-like: unequal widths, one column tile straddles a boundary
    offsets = (0, 24, 32, 40)
    x = torch.randn(sum(lens), k, generator=gen).to(DEVICE, dtype)
    a = (0.2 * torch.randn(slots_n, len(slices), rank, k, generator=gen)).to(DEVICE, dtype)
    a[1, :, rank - 3 :] = 0  # a lower-rank adapter, zero-padded in its slot
    b = (0.2 * torch.randn(slots_n, sum(slices), rank, generator=gen)).to(DEVICE, dtype)
    token_slots = torch.tensor(
        [s for n, s in zip(lens, seg_slots) for _ in range(n)], dtype=torch.int32, device=DEVICE
    )
    y = torch.randn(sum(lens), sum(slices), generator=gen).to(DEVICE, dtype)
    return x, a, b, y, token_slots, offsets


TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def test_rows_group_by_slot_in_row_order() -> None:
    token_slots = torch.tensor([2, -1, 0, 2, 2, -1, 0], dtype=torch.int32)
    rows = slot_rows_ref(token_slots, num_slots=4)
    assert rows.order.tolist() == [2, 6, 0, 3, 4] and rows.num_tiles == 2
    assert rows.tiles.tolist() == [[0, 2], [0, 2], [2, 3]]  # (slot, start, length) by column
    padded = slot_rows_ref(token_slots, num_slots=4, padded=True)
    assert padded.num_tiles is None and padded.tiles.shape == (3, 1 + 4)  # cdiv(7, 16) + slots
    assert torch.equal(padded.tiles[:, :2], rows.tiles) and not padded.tiles[:, 2:].any()


def test_tiles_cut_each_slot_at_block_m() -> None:
    """Slots of 0, 35, 16 and 1 rows: 3 + 1 + 1 tiles, each inside one slot, covering its rows once."""
    table = tile_table(np.array([0, 35, 16, 1]))
    assert table.tolist() == [[1, 1, 1, 2, 3], [0, 16, 32, 35, 51], [16, 16, 3, 16, 1]]
    assert tile_table(np.array([0, 35, 16, 1]), 9)[:, 5:].tolist() == [[0] * 4] * 3
    assert max_tiles(52, 4) == 8 and tile_table(np.zeros(3, dtype=np.int64)).shape == (3, 0)
    with pytest.raises(ValueError, match="5 tiles do not fit a table of 4"):
        tile_table(np.array([0, 35, 16, 1]), 4)
    # a prefill step's tiles: 64 rows (PREFILL_BLOCK_M)
    table = tile_table(np.array([0, 135, 16]), block_m=PREFILL_BLOCK_M)
    assert table.tolist() == [[1, 1, 1, 2], [0, 64, 128, 135], [64, 64, 7, 16]]
    assert max_tiles(135 + 16, 3, PREFILL_BLOCK_M) == 6
    rows = slot_rows_ref(torch.tensor([1] * 70 + [0] * 3, dtype=torch.int32), 2)
    assert rows.block_m == PREFILL_BLOCK_M and rows.tiles.tolist() == [[0, 1, 1], [0, 3, 67], [3, 64, 6]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_shrink_and_expand_match_reference(dtype: torch.dtype, step: str) -> None:
    # prefill: a 70-row request (two 64-row tiles, the second short), decodes, base rows between
    # adapters, a slot twice, an idle slot; decode: a row each, the grid over every row (as a graph
    # captures it)
    lens, seg_slots = [70, 1, 3, 1, 5], [2, -1, 0, 2, 2]
    if step == "decode":
        lens, seg_slots = [1] * 6, [0, -1, 2, 2, 0, -1]
    x, a, b, y, token_slots, offsets = setup(dtype, 0, lens, seg_slots)
    rows = slot_rows_ref(token_slots, a.shape[0], padded=step == "decode")
    h = lora_shrink(x, a, rows)
    h_ref = lora_shrink_ref(x, a, token_slots)
    adapted = token_slots >= 0
    torch.testing.assert_close(h, h_ref, atol=TOL[dtype], rtol=TOL[dtype])  # zeros on base rows
    unzeroed = lora_shrink(x, a, rows, zero_base_rows=False)  # base rows unwritten: the expand skips them
    torch.testing.assert_close(unzeroed[adapted], h_ref[adapted], atol=TOL[dtype], rtol=TOL[dtype])

    y_ref = y.clone()
    lora_expand_ref(y_ref, h_ref, b, token_slots, offsets)
    off_dev = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    lora_expand(y, h_ref, b, off_dev, max_slice=24, rows=rows)
    torch.testing.assert_close(y, y_ref, atol=TOL[dtype], rtol=TOL[dtype])
    # Base rows are untouched, adapter rows changed.
    assert torch.equal(y[~adapted], setup(dtype, 0, lens, seg_slots)[3][~adapted])
    assert not torch.equal(y_ref[adapted], setup(dtype, 0, lens, seg_slots)[3][adapted])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [2, 4])
def test_shrink_split_along_k_matches_reference(dtype: torch.dtype, splits: int) -> None:
    """K = 200 cut into parts 128 / 64 wide (the last one short: 64 + 64 + 64 + 8), partial sums
    added: the same h as one pass, as prefill and as a decode graph's grid; base rows zero."""
    gen = torch.Generator().manual_seed(7)
    lens, seg_slots = [19, 1, 3, 1, 5], [2, -1, 0, 2, 2]
    x = torch.randn(sum(lens), 200, generator=gen).to(DEVICE, dtype)
    a = (0.1 * torch.randn(3, 2, 8, 200, generator=gen)).to(DEVICE, dtype)
    token_slots = torch.tensor(
        [s for n, s in zip(lens, seg_slots) for _ in range(n)], dtype=torch.int32, device=DEVICE
    )
    h_ref = lora_shrink_ref(x, a, token_slots)
    one = lora_shrink(x, a, slot_rows_ref(token_slots, 3), splits=1)
    for rows in (slot_rows_ref(token_slots, 3), slot_rows_ref(token_slots, 3, padded=True)):
        h = lora_shrink(x, a, rows, splits=splits)
        torch.testing.assert_close(h, h_ref, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(h, one, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(h[token_slots < 0], torch.zeros_like(h[token_slots < 0]))


def test_shrink_splits_fill_the_gpu_on_decode_only() -> None:
    """Qwen3-8B's projections (a fused layer's slices fold into one dot: n = 1): a decode step of 1,024
    rows splits K so the grid has ~1,024 programs (parts at least 256 wide, multiples of 64, covering
    K once); a 16,384-row prefill step, and an input narrower than two parts, do not split."""
    for k, n in ((4096, 1), (12288, 1), (4096, 3)):
        splits, width = shrink_splits(k, 1024, n)
        assert width % 64 == 0 and width >= 256 and (splits - 1) * width < k <= splits * width
        assert 64 * n * splits >= 1024 or width == 256
        assert shrink_splits(k, 16384, n) == (1, k)
    assert shrink_splits(12288, 1024, 1) == (16, 768)
    assert shrink_splits(4096, 1024, 1) == (16, 256)
    assert shrink_splits(4096, 1024, 3) == (6, 704)  # slices that do not fold: a program each
    assert shrink_splits(300, 8, 1)[0] == 1


def test_fused_slices_fold_into_one_dot_only_when_back_to_back() -> None:
    """A's slices contiguous (LoRALinear's buffers): one dot of n x R columns; a strided A (slices
    apart) takes a program a slice. Both give the reference's h."""
    x, a, _, _, token_slots, _ = setup(torch.float32, 5, [19, 1, 3, 1, 5], [2, -1, 0, 2, 2])
    rows = slot_rows_ref(token_slots, a.shape[0])
    apart = torch.zeros(a.shape[0], a.shape[1], a.shape[2] + 2, a.shape[3], device=DEVICE)[:, :, :-2]
    apart.copy_(a)
    assert apart.stride(1) != apart.shape[2] * apart.stride(2)
    want = lora_shrink_ref(x, a, token_slots)
    for weights in (a, apart):
        torch.testing.assert_close(lora_shrink(x, weights, rows), want, atol=1e-4, rtol=1e-4)


def test_no_adapter_rows_change_nothing() -> None:
    """A decode graph's replay of a step of base rows only: every count 0, y untouched, h zero."""
    x, a, b, y, token_slots, offsets = setup(torch.float32, 4, [1] * 5, [-1] * 5)
    rows = slot_rows_ref(token_slots, a.shape[0], padded=True)
    assert not rows.tiles.any()
    h = lora_shrink(x, a, rows)
    before = y.clone()
    lora_expand(y, torch.ones_like(h), b, torch.tensor(offsets, dtype=torch.int32, device=DEVICE), 24, rows)
    assert torch.equal(h, torch.zeros_like(h)) and torch.equal(y, before)


def test_reference_is_the_per_row_formula() -> None:
    x, a, b, y, token_slots, offsets = setup(torch.float32, 1, [1] * 4, [1, -1, 0, 1])
    h = lora_shrink_ref(x, a, token_slots)
    out = y.clone()
    lora_expand_ref(out, h, b, token_slots, offsets)
    for t, slot in enumerate(token_slots.tolist()):
        want = y[t].clone()
        if slot >= 0:
            for s in range(3):
                lo, hi = offsets[s], offsets[s + 1]
                want[lo:hi] += b[slot, lo:hi] @ (a[slot, s] @ x[t])
        torch.testing.assert_close(out[t], want, atol=1e-5, rtol=1e-5)


def test_shapes_are_checked() -> None:
    x, a, _, _, token_slots, _ = setup(torch.float32, 2, [2], [0])
    rows = slot_rows_ref(token_slots, a.shape[0])
    with pytest.raises(ValueError, match="do not fit"):
        lora_shrink(x[:, :-1], a, rows)
    with pytest.raises(ValueError, match="int32"):
        lora_shrink(x, a, replace(rows, tiles=rows.tiles.long()))
    with pytest.raises(ValueError, match="is not \\[3, tiles\\]"):
        lora_shrink(x, a, replace(rows, tiles=rows.tiles[:2]))
    with pytest.raises(ValueError, match="4 tiles for a table of 1"):
        lora_shrink(x, a, replace(rows, num_tiles=None))  # a decode grid needs cdiv(2, 16) + 3


@pytest.mark.parametrize("decode_only", [False, True], ids=["prefill-step", "decode-step"])
def test_lora_linear_kernel_path_equals_reference_path(decode_only: bool, monkeypatch) -> None:
    """A wrapped fused layer (3 slices) through LoRABatch.map_rows, kernels forced on, against the same
    layer on the torch path; a step without adapters afterwards leaves every count 0 and the slot map
    all -1 (what a decode graph would read)."""
    from torch import nn

    from overnight.kernels import dispatch
    from overnight.lora.layers import LoRABatch, LoRALinear

    gen = torch.Generator().manual_seed(3)
    base = nn.Linear(32, 40, bias=False).to(DEVICE)
    batch = LoRABatch(max_tokens=64, max_slots=2, device=torch.device(DEVICE))
    layer = LoRALinear(base, batch, [24, 8, 8], max_loras=2, max_rank=8, dtype=torch.float32)
    layer.set_slot(0, [(0, torch.randn(4, 32, generator=gen), torch.randn(24, 4, generator=gen))])
    layer.set_slot(1, [(1, torch.randn(8, 32, generator=gen), torch.randn(8, 8, generator=gen)),
                       (2, torch.randn(8, 32, generator=gen), torch.randn(8, 8, generator=gen))])  # fmt: skip
    lens = [1, 1, 1] if decode_only else [1, 7, 18, 3]
    slots = [1, -1, 0] if decode_only else [0, 1, -1, 1]
    num_rows = sum(lens) + (1 if decode_only else 0)  # a padding row, as a graph bucket has
    x = torch.randn(num_rows, 32, generator=gen).to(DEVICE)
    batch.map_rows(slots, lens, num_rows, decode_only)
    # decode: the bucket's grid, cdiv(4, 16) + 2 tiles; prefill: slot 0's row, slot 1's 7 + 3
    assert batch.rows.num_tiles == (None if decode_only else 2)
    want = [[0, 1], [0, 1], [1, 1]] if decode_only else [[0, 1], [0, 1], [1, 10]]
    assert batch.rows.tiles[:, :2].tolist() == want and not batch.rows.tiles[:, 2:].any()
    with torch.no_grad():
        monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
        got = layer(x)
        monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
        want = layer(x)
        plain = base(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    rows = torch.tensor([s for n, s in zip(lens, slots) for _ in range(n)] + [-1] * (num_rows - sum(lens)))
    torch.testing.assert_close(got[rows < 0], plain[rows < 0])
    assert not torch.allclose(got[rows >= 0], plain[rows >= 0])
    batch.map_rows([-1, -1], [1, 1], 2, True)
    assert not batch.active and bool((batch.token_slots == -1).all())
    assert not batch.rows.tiles.any()


@pytest.mark.slow  # the interpreter compiles four kernels: ~10 s on two shared cores
def test_device_lora_wraps_every_projection_and_compiles_prefill_kernels(tmp_path, monkeypatch) -> None:
    """DeviceLoRA on a tiny Qwen3: the four projections of each layer wrapped, the start-up kernel pass
    (run on CUDA; forced here through the interpreter) leaves the map in its capture state."""
    from overnight.config import LoRAConfig
    from overnight.kernels import dispatch
    from overnight.loader.model_loader import load_model
    from overnight.loader.resolve import resolve_source
    from overnight.lora.slots import DeviceLoRA
    from tests.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path, "qwen3", num_hidden_layers=1)
    model = load_model(resolve_source(str(folder)), torch.float32, DEVICE)
    config = LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    lora = DeviceLoRA(model, model.arch, config, torch.float32, torch.device(DEVICE), max_tokens=32)
    assert sorted(path for _, path in lora.modules) == [
        "mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj", "self_attn.qkv_proj",
    ]  # fmt: skip
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    tiles: list[int] = []  # each pass's rows a tile: a prefill step's variant and a decode step's
    map_rows = lora.batch.map_rows

    def recording(*args, **kwargs) -> None:
        map_rows(*args, **kwargs)
        tiles.append(lora.batch.rows.block_m)

    monkeypatch.setattr(lora.batch, "map_rows", recording)
    lora._compile_prefill_kernels()
    assert tiles == [PREFILL_BLOCK_M, BLOCK_M] * 4  # four shapes of wrapped layer
    lora.batch.for_capture()
    assert lora.batch.active and lora.batch.rows.num_tiles is None
    assert bool((lora.batch.token_slots == -1).all()) and not lora.batch.rows.tiles.any()
