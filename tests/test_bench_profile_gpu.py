"""bench/profile_gpu.py's --timeline (bench/step_timeline.py, shared with profile_vllm.py): every step of a
whole run charged to its kind, no profiler."""

from __future__ import annotations

from tests.bench_scripts import load_bench_script


def test_a_runner_that_launches_ahead_has_its_waits_charged_one_step_back(monkeypatch):
    bench = load_bench_script(monkeypatch, "step_timeline.py")
    assert bench.walls_by_plan([0.1, 0.2, 0.3], [1, 2, 3], launches_ahead=True) == [0.2, 0.3, 0.0]
    assert bench.walls_by_plan([0.1, 0.2, 0.3], [1, 2, 3], launches_ahead=False) == [0.1, 0.2, 0.3]


def test_steps_are_grouped_by_decode_batch_and_prefill_size(monkeypatch):
    step_timeline = load_bench_script(monkeypatch, "step_timeline.py")
    Mix = step_timeline.Mix
    rows = [
        (Mix(16384, 72, 20000), 0.28),  # a prefill chunk of 16,312 tokens past one a request
        (Mix(9000, 200, 30000), 0.15),
        (Mix(256, 256, 300_000), 0.027),
        (Mix(300, 300, 400_000), 0.028),
        (Mix(63, 63, 1000), 0.006),
        (Mix(16000, 100, 25000), 0.27),
    ]
    table = step_timeline.step_kinds(rows)
    assert [kind.name for kind in table] == [
        "prefill 8192-16383 tokens",
        "decode 256-319 requests",
        "decode 0-63 requests",
    ]
    first = table[0]
    assert first.steps == 3 and abs(first.seconds - 0.70) < 1e-9
    assert first.extra_tokens == (16384 - 72) + (9000 - 200) + (16000 - 100)
    assert table[1][1:] == (2, 0.027 + 0.028, 0, 700_000)


def test_a_steps_context_is_what_its_requests_have_computed_once_it_runs(monkeypatch):
    """Both schedulers advance num_computed_tokens when they plan a step, so the sum over the scheduled
    requests is the context the step attends; a request not scheduled this step is not counted."""
    step_timeline = load_bench_script(monkeypatch, "step_timeline.py")

    class Req:
        def __init__(self, n: int) -> None:
            self.num_computed_tokens = n

    requests = {"a": Req(1025), "b": Req(300), "idle": Req(5000)}
    assert step_timeline.planned_mix(2, {"a": 1, "b": 1}, requests) == step_timeline.Mix(2, 2, 1325)


def test_timeline_writes_every_step(monkeypatch, tmp_path, capsys):
    bench = load_bench_script(monkeypatch, "profile_gpu.py")
    timeline_module = load_bench_script(monkeypatch, "step_timeline.py")
    mixes = [
        timeline_module.Mix(1024, 1, 1024),
        timeline_module.Mix(2, 2, 2050),
        timeline_module.Mix(2, 2, 2052),
    ]
    sched: list = []

    class Engine:
        _async = True

        class timings:
            @staticmethod
            def summary() -> dict:
                return {}

        def has_unfinished_requests(self) -> bool:
            return len(sched) < len(mixes)

        def step(self) -> None:
            sched.append(mixes[len(sched)])

    path = tmp_path / "steps.csv"
    assert bench.timeline(Engine(), sched, str(path)) == 0
    lines = path.read_text().splitlines()
    assert lines[0] == "step,tokens,requests,context,wall_ms"
    assert [line.split(",")[1:4] for line in lines[1:]] == [
        ["1024", "1", "1024"],
        ["2", "2", "2050"],
        ["2", "2", "2052"],
    ]
    out = capsys.readouterr().out
    assert "timeline: 3 steps" in out and "prefill 512-1023 tokens" in out and "decode 0-63 requests" in out


def test_vllms_timeline_reads_each_steps_mix_off_its_scheduler(monkeypatch, tmp_path, capsys):
    """profile_vllm.py --timeline against a stand-in for vLLM's in-process engine (vLLM itself needs a
    GPU): the requests go in, every step runs, and the scheduler's plans give each step its mix."""
    bench = load_bench_script(monkeypatch, "profile_vllm.py")
    plans = [(1024, 1), (2, 2), (2, 2), (0, 0)]  # the last plans nothing and is not a step

    class Plan:
        def __init__(self, tokens: int, requests: int) -> None:
            self.total_num_scheduled_tokens = tokens
            self.num_scheduled_tokens = {f"r{i}": 1 for i in range(requests)}

    class Req:  # vLLM's Request: num_computed_tokens advanced as the step is planned
        num_computed_tokens = 0

    class Scheduler:
        def __init__(self) -> None:
            self.requests: dict[str, Req] = {}

        def schedule(self) -> Plan:
            plan = Plan(*plans[len(added_steps)])
            for rid in plan.num_scheduled_tokens:
                req = self.requests.setdefault(rid, Req())
                req.num_computed_tokens += 1000 if plan.total_num_scheduled_tokens > 2 else 1
            return plan

    class Engine:
        def __init__(self) -> None:
            self.engine_core = type("Client", (), {})()
            self.engine_core.engine_core = type("Core", (), {"scheduler": Scheduler()})()

        def add_request(self, request_id, prompt, params) -> None:
            requests.append(request_id)

        def has_unfinished_requests(self) -> bool:
            return len(added_steps) < len(plans)

        def step(self) -> list:
            self.engine_core.engine_core.scheduler.schedule()
            added_steps.append(1)
            return []

    requests: list[str] = []
    added_steps: list[int] = []
    llm = type("LLM", (), {"llm_engine": Engine()})()
    args = type(
        "Args", (), {"timeline": str(tmp_path / "v.csv"), "steps": 0, "warmup_steps": 0, "workload": "w"}
    )
    assert (
        bench.by_step(llm, [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}], [None, None], args) == 0
    )
    assert requests == ["r0", "r1"]
    lines = (tmp_path / "v.csv").read_text().splitlines()
    assert [line.split(",")[1:4] for line in lines[1:]] == [
        ["1024", "1", "1000"],
        ["2", "2", "1002"],
        ["2", "2", "1004"],
    ]
    out = capsys.readouterr().out
    assert "vLLM timeline: 4 steps (3 scheduled)" in out and "prefill 512-1023 tokens" in out


def test_walls_go_to_the_step_each_call_waited_for(monkeypatch):
    timeline = load_bench_script(monkeypatch, "step_timeline.py")
    # one step planned and run per call
    assert timeline.walls_by_plan([1.0, 2.0, 3.0], [1, 2, 3], launches_ahead=False) == [1.0, 2.0, 3.0]
    # a call that plans nothing still waits for the latest step
    assert timeline.walls_by_plan([1.0, 2.0, 3.0], [1, 1, 2], launches_ahead=False) == [3.0, 3.0]
    # planning ahead: call k plans step k and waits for step k - 1; the last call only waits
    assert timeline.walls_by_plan([0.1, 2.0, 3.0, 4.0], [1, 2, 3, 3], launches_ahead=True) == [2.0, 3.0, 4.0]


def test_vllms_graph_mode_reaches_its_engine_only_when_asked(monkeypatch):
    bench = load_bench_script(monkeypatch, "profile_vllm.py")
    args = type("Args", (), {"kv_cache_dtype": "fp8", "quantization": "fp8", "cudagraph_mode": None})
    assert bench.profile_extra(args) == {"kv_cache_dtype": "fp8", "quantization": "fp8"}
    args.cudagraph_mode = "PIECEWISE"
    assert bench.profile_extra(args)["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}


def test_an_image_workload_is_submitted_with_its_pictures(monkeypatch, tmp_path):
    """submit() adds caption-448's requests with their preprocessed images (the image pad expanded to
    the picture's 256 tokens on Qwen2.5-VL), unrun; they then run to their 128 tokens."""
    from dataclasses import replace

    from overnight import LLM
    from overnight.bench.workloads import WORKLOADS
    from tests.test_bench_caption import PAD, TOKENS_448, _reduced_config

    bench = load_bench_script(monkeypatch, "profile_gpu.py")
    folder = _reduced_config("qwen2.5-vl-7b", str(tmp_path / "m"))
    llm = LLM(folder, load_format="dummy", device="cpu", dtype="float32", max_model_len=4096,
              kv_cache_memory_bytes=32 << 20)  # fmt: skip
    engine = llm.engine
    bench.submit(llm, replace(WORKLOADS["caption-448"], num_requests=2))
    reqs = engine.scheduler.requests
    assert sorted(reqs) == ["r0", "r1"]
    for r in reqs.values():
        assert r.prompt_token_ids.count(PAD) == TOKENS_448["qwen2.5-vl-7b"] and r.num_computed_tokens == 0
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert sorted(len(o.outputs[0].token_ids) for o in done) == [128, 128]
