"""The Prometheus observer on a fake-runner engine: names, labels, and counters equal to the work done."""

from __future__ import annotations

import random
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from overnight.metrics import PrometheusObserver, attach_metrics, start_metrics_server
from overnight.metrics.prometheus import token_buckets
from overnight.sampling_params import SamplingParams
from tests.engine_helpers import make_engine, run_all


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(page: dict, name: str, **labels: str) -> float:
    labels.setdefault("model_name", "fake")
    return page[(name, tuple(sorted(labels.items())))]


def test_counters_equal_the_work_done():
    engine, _ = make_engine(max_num_batched_tokens=64)
    metrics = attach_metrics(engine, model_name="fake")
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(5, 40))] for _ in range(12)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=7, ignore_eos=True))
    run_all(engine)
    page = samples(metrics.render().decode())
    assert value(page, "overnight:prompt_tokens_total") == sum(map(len, prompts))
    assert value(page, "overnight:generation_tokens_total") == 7 * len(prompts)
    assert value(page, "overnight:request_success_total", finished_reason="length") == len(prompts)
    assert value(page, "overnight:request_success_total", finished_reason="stop") == 0
    assert value(page, "overnight:num_requests_running") == 0
    assert value(page, "overnight:num_requests_waiting") == 0
    assert value(page, "overnight:kv_cache_usage_perc") == 0
    # one TTFT per request, six inter-token gaps each, one e2e/queue/length sample per request
    assert value(page, "overnight:time_to_first_token_seconds_count") == len(prompts)
    assert value(page, "overnight:inter_token_latency_seconds_count") == 6 * len(prompts)
    assert value(page, "overnight:e2e_request_latency_seconds_count") == len(prompts)
    assert value(page, "overnight:request_queue_time_seconds_count") == len(prompts)
    assert value(page, "overnight:request_prompt_tokens_sum") == sum(map(len, prompts))
    assert value(page, "overnight:request_generation_tokens_sum") == 7 * len(prompts)
    # every forward pass is observed once; together they computed every prompt and decode token
    assert value(page, "overnight:iteration_tokens_total_count") == engine.num_steps
    assert value(page, "overnight:iteration_tokens_total_sum") == sum(map(len, prompts)) + 6 * len(prompts)


def test_gauges_follow_the_queues_and_prefix_cache_counts_tokens():
    engine, _ = make_engine(max_num_seqs=2, block_size=4)
    metrics = attach_metrics(engine, model_name="fake")
    shared = list(range(10, 30))  # 20 tokens: 4 full blocks of 4 can be reused (one token is left)
    for i in range(5):
        engine.add_request(str(i), shared + [100 + i], SamplingParams(max_tokens=4, ignore_eos=True))
    metrics.update_gauges(engine.stats())
    page = samples(metrics.render().decode())
    assert value(page, "overnight:num_requests_waiting") == 5
    engine.step()
    page = samples(metrics.render().decode())
    assert value(page, "overnight:num_requests_running") == 2
    assert value(page, "overnight:num_requests_waiting") == 3
    assert 0 < value(page, "overnight:kv_cache_usage_perc") <= 1
    run_all(engine)
    page = samples(metrics.render().decode())
    queries = value(page, "overnight:prefix_cache_queries_total")
    hits = value(page, "overnight:prefix_cache_hits_total")
    assert queries == 5 * 21
    # the first two run together and miss; the three later ones each reuse the 20 shared tokens
    assert hits == 3 * 20
    assert value(page, "overnight:kv_cache_usage_perc") == 0


def test_preemptions_counted():
    # 12 blocks of 4 tokens: four requests growing to 2 + 20 tokens cannot all keep their blocks
    # (greedy admission starts them all at once).
    engine, _ = make_engine(num_blocks=12, block_size=4, max_num_seqs=4, max_model_len=40, admission="greedy")
    metrics = attach_metrics(engine, model_name="fake")
    for i in range(4):
        engine.add_request(str(i), [5 + i, 6 + i], SamplingParams(max_tokens=20, ignore_eos=True))
    run_all(engine)
    page = samples(metrics.render().decode())
    assert engine.stats().num_preemptions_total > 0
    assert value(page, "overnight:num_preemptions_total") == engine.stats().num_preemptions_total
    # preempted requests recompute, but their prompts are counted once
    assert value(page, "overnight:prompt_tokens_total") == 8


def test_vllm_prefix_and_separate_registries():
    engine, _ = make_engine()
    a = attach_metrics(engine, prefix="vllm", model_name="fake")
    b = PrometheusObserver("other")  # its own registry: no clash with a's names
    engine.add_request("x", [7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    run_all(engine)
    page = samples(a.render().decode())
    assert value(page, "vllm:generation_tokens_total") == 2
    assert not any(name.startswith("overnight:") for name, _ in page)
    assert b"vllm:" not in b.render()


def test_served_on_a_port():
    engine, _ = make_engine()
    metrics = attach_metrics(engine, model_name="fake")
    port = start_metrics_server(metrics, 0)
    engine.add_request("x", [7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    run_all(engine)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        page = samples(r.read().decode())
    assert value(page, "overnight:generation_tokens_total") == 3
    assert not any(name.endswith("_created") for name, _ in page)


def test_token_buckets_cover_max_model_len():
    assert token_buckets(1) == (1,)
    assert token_buckets(8192)[-1] == 10000
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


def test_every_name_dashboards_query_is_there():
    engine, _ = make_engine()
    metrics = attach_metrics(engine, prefix="vllm", model_name="fake")
    engine.add_request("x", [7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    run_all(engine)
    names = {name for name, _ in samples(metrics.render().decode())}
    for short in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "request_success_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
        "request_prompt_tokens_count",
        "request_generation_tokens_count",
        "iteration_tokens_total_count",
    ):
        assert f"vllm:{short}" in names, short


def test_offline_class_with_metrics_on_a_port(tmp_path):
    from overnight import LLM
    from tests.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path, "qwen3")
    llm = LLM(model=str(folder), skip_tokenizer_init=True, max_model_len=128)
    metrics = attach_metrics(llm.engine)
    port = start_metrics_server(metrics, 0)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        page = samples(r.read().decode())
    name = metrics.model_name
    assert name == str(folder)
    assert value(page, "overnight:prompt_tokens_total", model_name=name) == 9
    assert (
        value(page, "overnight:generation_tokens_total", model_name=name)
        == sum(len(o.outputs[0].token_ids) for o in outs)
        == 15
    )
    assert value(page, "overnight:request_success_total", model_name=name, finished_reason="length") == 3
    assert value(page, "overnight:num_requests_running", model_name=name) == 0


def test_finished_time_is_never_before_the_last_token():
    engine, _ = make_engine()
    for i in range(12):
        engine.add_request(str(i), [5 + i, 6, 7], SamplingParams(max_tokens=1 + i % 4, n=1 + i % 2))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert len(done) == 12
    for o in done:
        m = o.metrics
        assert m.first_token_time is not None and m.last_token_time is not None
        assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
