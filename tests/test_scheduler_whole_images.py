"""Tier (a): images whose tokens attend both ways (Gemma 3: MultiModalInputs.whole_images) are computed
within one prefill chunk. Chunks and prefix-cache hits never end strictly inside one; an image larger
than the step budget is refused at admission; nothing starves. Fake runner, no weights."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from overnight.errors import InvalidRequestError
from overnight.multimodal.inputs import ImageInput, MultiModalInputs
from overnight.sampling_params import SamplingParams
from tests.engine_helpers import VOCAB, make_engine, run_all


def images_at(spans: list[tuple[int, int]], whole: bool = True) -> MultiModalInputs:
    ims = tuple(ImageInput(a, b - a, f"h{a}-{b}", torch.zeros(1, 1), (1, 1, b - a)) for a, b in spans)
    return MultiModalInputs(ims, np.zeros((3, 0), dtype=np.int64), 0, whole_images=whole)


def record_chunks(engine) -> list[tuple[str, int, int]]:
    """(request, first token, tokens) of every prefill or decode chunk the scheduler hands out."""
    log: list[tuple[str, int, int]] = []
    schedule = engine.scheduler.schedule

    def wrapped():
        before = {rid: r.num_computed_tokens for rid, r in engine.scheduler.requests.items()}
        out = schedule()
        starts = {n.req_id: n.num_computed_tokens for n in out.new_reqs}
        for rid, n in out.num_scheduled_tokens.items():
            log.append((rid, starts.get(rid, before[rid]), n))
        return out

    engine.scheduler.schedule = wrapped
    return log


def inside(spans: list[tuple[int, int]], pos: int) -> bool:
    return any(a < pos < b for a, b in spans)


def test_chunks_never_end_inside_an_image():
    engine, _ = make_engine(max_num_batched_tokens=16, block_size=4, max_num_seqs=4)
    log = record_chunks(engine)
    rng = random.Random(0)
    spans_of: dict[str, list[tuple[int, int]]] = {}
    for i in range(12):
        n = rng.randint(20, 60)
        a = rng.randint(0, n - 14)
        b = a + rng.randint(3, 14)  # up to 14 of the 16-token budget
        spans = [(a, b)] if b < n - 2 else [(a, n - 2)]
        spans_of[str(i)] = spans
        prompt = [rng.randrange(10, VOCAB) for _ in range(n)]
        engine.add_request(
            str(i), prompt, SamplingParams(max_tokens=5, ignore_eos=True), multi_modal=images_at(spans)
        )
    results = run_all(engine)
    assert sorted(results, key=int) == [str(i) for i in range(12)]
    assert all(len(t) == 5 for t in results.values())
    cut = 0
    for rid, start, n in log:
        assert not inside(spans_of[rid], start + n), (rid, start, n)
        assert not inside(spans_of[rid], start), (rid, start, n)
        cut += n < 16 and any(a < start + 16 < b for a, b in spans_of[rid])
    assert cut > 0, "no chunk was shortened: the test did not reach the case"


def test_prefix_hit_stops_before_an_image():
    engine, _ = make_engine(max_num_batched_tokens=64, block_size=4)
    log = record_chunks(engine)
    prompt = list(range(10, 34))  # 24 tokens; blocks of 4; the image covers 6 .. 22
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("a", prompt, params, multi_modal=images_at([(6, 22)]))
    run_all(engine)
    engine.add_request("b", prompt, params, multi_modal=images_at([(6, 22)]))
    run_all(engine)
    first_b = next((start, n) for rid, start, n in log if rid == "b")
    assert first_b[0] == 4  # 5 cached blocks would end at 20, inside the image: cut back to block 1
    # Without whole images the same prompt hits 5 blocks.
    engine.add_request("c", prompt, params, multi_modal=images_at([(6, 22)], whole=False))
    run_all(engine)
    assert next(start for rid, start, _ in log if rid == "c") == 20


def test_image_larger_than_the_budget_is_refused():
    engine, _ = make_engine(max_num_batched_tokens=8)
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        engine.add_request(
            "x", list(range(10, 30)), SamplingParams(max_tokens=2), multi_modal=images_at([(2, 12)])
        )
    assert not engine.has_unfinished_requests()
    # A split-able image of the same size is fine.
    engine.add_request(
        "y", list(range(10, 30)), SamplingParams(max_tokens=2), multi_modal=images_at([(2, 12)], False)
    )
    assert len(run_all(engine)["y"]) == 2


def test_image_that_fills_the_budget_waits_for_room_behind_decodes():
    """An image exactly as large as the budget, queued behind running decodes, starts once they leave
    room (never a chunk inside it)."""
    engine, _ = make_engine(max_num_batched_tokens=12, block_size=4, max_num_seqs=4)
    log = record_chunks(engine)
    for i in range(3):
        engine.add_request(f"d{i}", [20 + i, 21, 22], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request(
        "img",
        list(range(10, 30)),
        SamplingParams(max_tokens=3, ignore_eos=True),
        multi_modal=images_at([(4, 16)]),
    )
    results = run_all(engine)
    assert len(results["img"]) == 3
    assert all(not inside([(4, 16)], s + n) for rid, s, n in log if rid == "img")
