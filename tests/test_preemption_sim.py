"""bench/preemption_sim.py's decode bands: the decode-only steps by 64 requests and the context they
attend (what docs/performance.md sets beside each engine's timeline)."""

from __future__ import annotations

from tests.bench_scripts import load_bench_script


def test_decode_bands_count_the_steps_and_the_context_they_attend(monkeypatch):
    sim = load_bench_script(monkeypatch, "preemption_sim.py")
    r = sim.simulate(num_requests=8, prompt_len=32, max_tokens=8, pool_tokens=100_000)
    # one step prefills all 8 prompts and samples their first tokens; 7 decode steps follow, step j
    # attending 32 + j tokens of each request
    assert r["steps"] == 8 and r["preemptions"] == 0
    assert r["decode_bands"] == {"0-63": {"steps": 7, "mean_context": 8 * 36}}


def test_a_pool_too_small_for_all_splits_the_decode_steps_by_batch(monkeypatch):
    sim = load_bench_script(monkeypatch, "preemption_sim.py")
    r = sim.simulate(num_requests=96, prompt_len=64, max_tokens=32, pool_tokens=64 * 96, planned=False)
    bands = r["decode_bands"]
    assert sum(b["steps"] for b in bands.values()) < r["steps"]  # prefill steps are not in a band
    assert all(b["mean_context"] <= 64 * 96 for b in bands.values())  # never more than the pool holds


def test_model_sets_the_admission_the_engine_plans_with(monkeypatch):
    """--model: the preset's tail share and step tokens (engine/admission.py), a dense model's without."""
    from overnight.config import DENSE_STEP_TOKENS, DENSE_TAIL_SHARE
    from overnight.engine.admission import MAX_TAIL_SHARE

    sim = load_bench_script(monkeypatch, "preemption_sim.py")
    assert sim.admission_of(None) == (DENSE_TAIL_SHARE, DENSE_STEP_TOKENS)
    assert sim.admission_of("qwen3-8b") == (DENSE_TAIL_SHARE, DENSE_STEP_TOKENS)
    share, step = sim.admission_of("qwen3-30b-a3b")
    assert share == MAX_TAIL_SHARE and step > 10 * DENSE_STEP_TOKENS
