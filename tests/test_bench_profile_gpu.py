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
    rows = [
        ((16384, 72), 0.28),  # a prefill chunk of 16,312 tokens past one a request
        ((9000, 200), 0.15),
        ((256, 256), 0.027),
        ((300, 300), 0.028),
        ((63, 63), 0.006),
        ((16000, 100), 0.27),
    ]
    table = step_timeline.step_kinds(rows)
    assert [kind for kind, *_ in table] == [
        "prefill 8192-16383 tokens",
        "decode 256-319 requests",
        "decode 0-63 requests",
    ]
    kind, steps, secs, extra = table[0]
    assert steps == 3 and abs(secs - 0.70) < 1e-9 and extra == (16384 - 72) + (9000 - 200) + (16000 - 100)
    assert table[1][1:] == (2, 0.027 + 0.028, 0)


def test_timeline_writes_every_step(monkeypatch, tmp_path, capsys):
    bench = load_bench_script(monkeypatch, "profile_gpu.py")
    mixes = [(1024, 1), (2, 2), (2, 2)]
    sched: list[tuple[int, int]] = []

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
    assert lines[0] == "step,tokens,requests,wall_ms"
    assert [line.split(",")[1:3] for line in lines[1:]] == [["1024", "1"], ["2", "2"], ["2", "2"]]
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

    class Scheduler:
        def schedule(self) -> Plan:
            return Plan(*plans[len(added_steps)])

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
    assert [line.split(",")[1:3] for line in lines[1:]] == [["1024", "1"], ["2", "2"], ["2", "2"]]
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
