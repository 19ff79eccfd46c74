"""bench/w4a16_tiers_gpu.py's tier planning on the CPU: the winners per M from a timing table, the tiers
built from them (and what the kernel's default_config then picks), and --apply's round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest

from overnight.kernels import w4a16_gemm
from overnight.kernels.w4a16_gemm import W4A16Config
from tests.bench_scripts import load_bench_script

# the tiers the plans below start from (session V's: the 64-row swapped tile to 127 rows)
START_TIERS = (
    (64, W4A16Config(64, 64, swap_ab=True)),
    (127, W4A16Config(64, 64, swap_ab=True)),
    (128, W4A16Config(128, 128, num_warps=8, num_stages=3, swap_ab=True)),
    (1 << 62, W4A16Config(128, 128, 1, 8, 3, 64, scale_after=False)),
)


@pytest.fixture()
def tiers(monkeypatch):
    monkeypatch.setattr(w4a16_gemm, "TIERS", START_TIERS)
    monkeypatch.setattr(w4a16_gemm, "DEQUANT_GEMM_MIN_M", w4a16_gemm.DEQUANT_GEMM_MIN_M)
    monkeypatch.setattr(w4a16_gemm, "MMA_DEQUANT_GEMM_MIN_M", w4a16_gemm.MMA_DEQUANT_GEMM_MIN_M)
    monkeypatch.setattr(w4a16_gemm, "MMA_ORDER", w4a16_gemm.MMA_ORDER)
    return load_bench_script(monkeypatch, "w4a16_tiers_gpu.py")


VARIANTS = {
    "default": lambda m: None,
    "swap-a": lambda m: W4A16Config(64, 64, swap_ab=True),
    "swap-b": lambda m: W4A16Config(128, 64, num_warps=8, swap_ab=True),
}


def table(speedups: dict[int, dict[str, tuple[float, float]]]) -> list[dict]:
    return [
        {"M": m, "variant": name, "x_bf16": x, "shape": shape}
        for m, by_name in speedups.items()
        for name, xs in by_name.items()
        for shape, x in zip(("o", "down"), xs)
    ]


def test_winners_take_the_geometric_mean_over_every_shape(tiers):
    t = table(
        {
            # swap-a's arithmetic mean is the larger (.65), swap-b's geometric mean (.62 against .6)
            128: {"default": (0.5, 0.5), "swap-a": (0.9, 0.4), "swap-b": (0.62, 0.62)},
            256: {"default": (0.5, 0.5), "swap-a": (2.0, 0.1), "swap-b": (0.55, 0.55)},
        }
    )
    t.append({"M": 256, "variant": "swap-a", "x_bf16": 9.0, "shape": "o"})  # a third shape: not all ran
    best = tiers.winners(t, VARIANTS, (128, 256), shapes=2)
    assert best == {128: "swap-b", 256: "swap-b"}


def test_new_tiers_stop_at_the_first_m_the_default_wins(tiers):
    w4a16_gemm.DEQUANT_GEMM_MIN_M = 128  # the fixture puts the module's value back
    assert tiers.new_tiers({128: "default", 192: "swap-a"}, VARIANTS) is None  # dequantize wins first
    planned = tiers.new_tiers({128: "swap-a", 192: "swap-b", 256: "default", 384: "swap-a"}, VARIANTS)
    assert planned is not None
    spec, min_m = planned
    assert min_m == 193
    tiers.apply(json.dumps(planned))
    assert w4a16_gemm.DEQUANT_GEMM_MIN_M == 193
    assert w4a16_gemm.default_config(100) == W4A16Config(64, 64, swap_ab=True)  # the old tier below 128
    assert w4a16_gemm.default_config(128) == VARIANTS["swap-a"](128)
    assert w4a16_gemm.default_config(150) == VARIANTS["swap-b"](150)
    assert w4a16_gemm.default_config(193).path == "dequant"
    assert w4a16_gemm.default_config(4096).path == "dequant"
    # below DEQUANT_GEMM_MIN_M (128 again) the default is the fused 64-row tier: its win is no stop
    w4a16_gemm.DEQUANT_GEMM_MIN_M = 128
    planned = tiers.new_tiers({96: "default", 128: "swap-b", 160: "default"}, VARIANTS)
    assert planned is not None and planned[1] == 129
    tiers.apply(json.dumps(planned))
    assert w4a16_gemm.default_config(120) == W4A16Config(64, 64, swap_ab=True)  # the tier to 127 stays
    assert w4a16_gemm.default_config(128) == VARIANTS["swap-b"](128)
    assert w4a16_gemm.default_config(129).path == "dequant"


def test_a_default_win_between_fused_winners_keeps_its_tier(tiers):
    """Below the threshold the default is a fused tier: a win there after a fused winner keeps that
    tier for its rows (it was once dropped, giving those rows the next winner's tile)."""
    w4a16_gemm.DEQUANT_GEMM_MIN_M = 300
    planned = tiers.new_tiers({128: "swap-b", 192: "default", 256: "swap-a", 384: "default"}, VARIANTS)
    assert planned is not None and planned[1] == 257
    tiers.apply(json.dumps(planned))
    assert w4a16_gemm.default_config(128) == VARIANTS["swap-b"](128)
    assert w4a16_gemm.default_config(150) == START_TIERS[3][1]  # the default's tier at 192 rows
    assert w4a16_gemm.default_config(200) == VARIANTS["swap-a"](200)
    assert w4a16_gemm.default_config(257).path == "dequant"


def test_apply_sets_the_threshold_of_the_words_order(tiers):
    """[tiers, threshold] is this bench's column-order plan; a third item true is an MMA-order plan,
    whose threshold is MMA_DEQUANT_GEMM_MIN_M; the other order's threshold is left alone."""
    column, mma = w4a16_gemm.DEQUANT_GEMM_MIN_M, w4a16_gemm.MMA_DEQUANT_GEMM_MIN_M
    spec = [[[b, dataclasses.asdict(c)] for b, c in START_TIERS]]
    tiers.apply(json.dumps([*spec, 150, True]))
    assert (w4a16_gemm.MMA_ORDER, w4a16_gemm.MMA_DEQUANT_GEMM_MIN_M) == (True, 150)
    assert w4a16_gemm.DEQUANT_GEMM_MIN_M == column
    assert w4a16_gemm.default_config(150, mma_order=True).path == "dequant"
    assert w4a16_gemm.default_config(149, mma_order=True).path == "fused"
    tiers.apply(json.dumps([*spec, 140]))
    assert (w4a16_gemm.MMA_ORDER, w4a16_gemm.DEQUANT_GEMM_MIN_M) == (False, 140)
    assert w4a16_gemm.MMA_DEQUANT_GEMM_MIN_M == 150 != mma
