"""run-batch end to end on a tiny random model with a tiny word-level tokenizer built here: the mixed-file
round trip (bodies valid for the official openai types, greedy and seeded outputs equal LLM.generate),
every kind of bad line, resume of a torn file, ordering, stdin/stdout, --validate-only (the model, the
lines and the command runners: tests/batch_helpers.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.batch_helpers import (
    MAX_MODEL_LEN,
    SERVED,
    VOCAB,
    WORDS,
    chat_line,
    completion_line,
    engine_flags,
    expected_texts,
    mixed_lines,
    read_jsonl,
    run_cli,
    run_subprocess,
    words,
    write_jsonl,
)

pytestmark = pytest.mark.slow  # runs the real model


# ---- the mixed file ---------------------------------------------------------------------------


def test_mixed_file_round_trip(batch_model, tmp_path):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    lines = mixed_lines(300)
    write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert (
        run_cli(
            [
                "-i",
                str(tmp_path / "in.jsonl"),
                "-o",
                str(out),
                *engine_flags(batch_model),
                "--summary-json",
                str(tmp_path / "s.json"),
            ]
        )
        == 0
    )
    results = read_jsonl(out)
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines]  # input order
    expected = expected_texts(batch_model, lines)
    by_id = {line["custom_id"]: line for line in lines}
    for r in results:
        assert r["error"] is None and r["response"]["status_code"] == 200, r
        assert r["id"].startswith("batch_req_")
        body, line = r["response"]["body"], by_id[r["custom_id"]]
        if line["url"] == "/v1/chat/completions":
            parsed = ChatCompletion.model_validate(body)
            texts = [c.message.content for c in parsed.choices]
            if line["body"].get("logprobs"):
                for c in parsed.choices:
                    assert c.logprobs is not None and c.logprobs.content
                    assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
        else:
            parsed = Completion.model_validate(body)
            texts = [c.text for c in parsed.choices]
            if line["body"].get("logprobs") is not None:
                assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in parsed.choices)
        assert parsed.model == SERVED
        assert [c.index for c in parsed.choices] == list(range(len(parsed.choices)))
        assert texts == expected[r["custom_id"]], r["custom_id"]
        n_prompts = (
            len(line["body"]["prompt"])
            if isinstance(line["body"].get("prompt"), list)
            and isinstance(line["body"]["prompt"][0], (str, list))
            else 1
        )
        assert len(parsed.choices) == n_prompts * line["body"].get("n", 1)
        assert parsed.usage.completion_tokens >= len(parsed.choices)
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["ok"] == 300 and summary["failed"] == 0 and summary["status"] == "completed"
    assert summary["completion_tokens"] == sum(
        r["response"]["body"]["usage"]["completion_tokens"] for r in results
    )


# ---- bad lines ----------------------------------------------------------------------------------


def bad_lines() -> list[tuple[str | dict, str, str | None]]:
    """(line, expected error code, expected custom_id in the error line)."""
    ok = {"messages": [{"role": "user", "content": "w10 w11"}], "max_tokens": 2}
    chat = "/v1/chat/completions"
    long_prompt = " ".join(WORDS[: MAX_MODEL_LEN + 5])
    return [
        ('{"custom_id": "bad-json", "method": "POST", "url": ', "invalid_json", "bad-json"),
        ("this is not json at all", "invalid_json", None),
        ("[1, 2, 3]", "invalid_line", None),
        ({"method": "POST", "url": chat, "body": ok}, "invalid_line", None),
        ({"custom_id": "no-method", "url": chat, "body": ok}, "invalid_line", "no-method"),
        ({"custom_id": "get", "method": "GET", "url": chat, "body": ok}, "invalid_method", "get"),
        (
            {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "w9"}},
            "unsupported_model",  # a generation model: embedding lines need --runner pooling
            "embed",
        ),
        ({"custom_id": "no-body", "method": "POST", "url": chat}, "invalid_line", "no-body"),
        (chat_line("hot", "w10", temperature=2.5), "invalid_request", "hot"),
        (chat_line("zero-max", "w10", max_tokens=0), "invalid_request", "zero-max"),
        (
            {"custom_id": "no-messages", "method": "POST", "url": chat, "body": {"messages": []}},
            "invalid_request",
            "no-messages",
        ),
        (chat_line("other-model", "w10", model="gpt-4o", max_tokens=2), "model_not_found", "other-model"),
        (completion_line("too-long", long_prompt, max_tokens=2), "context_length_exceeded", "too-long"),
        # A duplicate is answered under its line number: one record per custom_id in the output.
        (chat_line("good-1", "w12 w13", max_tokens=2), "duplicate_custom_id", None),
        ({"custom_id": 7, "method": "POST", "url": chat, "body": ok}, "invalid_line", None),
        (
            completion_line("over-context", "w10 w11", max_tokens=MAX_MODEL_LEN),
            "context_length_exceeded",
            "over-context",
        ),
        (chat_line("tools", "w10", tools=[{"type": "function"}]), "invalid_request", "tools"),
        (chat_line("backend", "w10", guided_decoding_backend="xgrammar"), "invalid_request", "backend"),
        (completion_line("oov", [5, VOCAB + 7], max_tokens=2), "invalid_request", "oov"),
        (completion_line("no-prompt", None, max_tokens=2), "invalid_request", "no-prompt"),
        (
            {
                "custom_id": "image",
                "method": "POST",
                "url": chat,
                "body": {
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                    ]
                },
            },
            "invalid_request",
            "image",
        ),
        (
            completion_line("min-over-max", "w10", max_tokens=2, min_tokens=5),
            "invalid_request",
            "min-over-max",
        ),
        (completion_line("empty-prompt", "", max_tokens=2), "invalid_request", "empty-prompt"),
        (b'{"custom_id": "bad-utf8", "body": "\xff\xfe"}', "invalid_json", "bad-utf8"),
    ]


def write_with_good_lines(path: Path, bad: list) -> tuple[list[str], dict[int, tuple[str, str | None]]]:
    """Each bad line between two good ones; returns the good ids and {line number: (code, custom_id)}."""
    good, expect = [], {}
    with open(path, "wb") as f:
        line_no = 0

        def put(item) -> None:
            nonlocal line_no
            line_no += 1
            data = (
                item
                if isinstance(item, bytes)
                else (item if isinstance(item, str) else json.dumps(item)).encode()
            )
            f.write(data + b"\n")

        for i, (line, code, cid) in enumerate(bad):
            gid = f"good-{i}"
            put(
                chat_line(gid, f"w{20 + i} w30", max_tokens=2, temperature=0)
                if i % 2
                else completion_line(gid, f"w{20 + i}", max_tokens=2, temperature=0)
            )
            good.append(gid)
            put(line)
            expect[line_no] = (code, cid)
        put(chat_line("good-last", "w40", max_tokens=2))
        good.append("good-last")
    return good, expect


def test_every_kind_of_bad_line_gets_its_error_and_the_rest_are_served(batch_model, tmp_path):
    bad = bad_lines()
    assert len({code for _, code, _ in bad}) >= 8 and len(bad) >= 15
    good, expect = write_with_good_lines(tmp_path / "in.jsonl", bad)
    out = tmp_path / "out.jsonl"
    assert run_cli(["-i", str(tmp_path / "in.jsonl"), "-o", str(out), *engine_flags(batch_model)]) == 0
    results = read_jsonl(out)
    assert len(results) == len(good) + len(bad)
    failures = [r for r in results if r["error"] is not None]
    served = [r for r in results if r["error"] is None]
    assert [r["custom_id"] for r in served] == good
    assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["choices"] for r in served)
    assert len(failures) == len(bad)
    for r in failures:
        line_no = int(r["error"]["message"].split(":")[0].removeprefix("line "))
        code, cid = expect[line_no]
        assert (r["error"]["code"], r["custom_id"]) == (code, cid), r
        if cid is None:  # no id to name it by: its line is named instead
            assert r["line"] == line_no
        assert r["response"]["body"] is None
        assert r["response"]["status_code"] == (404 if code == "model_not_found" else 400)
        assert r["id"].startswith("batch_req_") and r["response"]["request_id"]
    by_code = {r["error"]["code"]: r["error"]["message"] for r in failures}
    assert "temperature" in by_code["invalid_request"] or any(
        "temperature" in r["error"]["message"] for r in failures
    )
    assert f"maximum context length is {MAX_MODEL_LEN}" in by_code["context_length_exceeded"]
    ids = [r["custom_id"] for r in results if r["custom_id"] is not None]
    assert len(ids) == len(set(ids)), "at most one record per custom_id"
    over = next(r for r in failures if r["custom_id"] == "over-context")["error"]["message"]
    assert f"2 in the prompt + {MAX_MODEL_LEN} of max_tokens" in over, over


def test_errors_file_and_validate_only(batch_model, tmp_path, monkeypatch, capsys):
    bad = bad_lines()
    good, expect = write_with_good_lines(tmp_path / "in.jsonl", bad)
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    assert (
        run_cli(
            [
                "-i",
                str(tmp_path / "in.jsonl"),
                "-o",
                str(out),
                "--errors-file",
                str(errors),
                *engine_flags(batch_model),
            ]
        )
        == 0
    )
    assert [r["custom_id"] for r in read_jsonl(out)] == good
    written = read_jsonl(errors)
    assert sorted(r["error"]["code"] for r in written) == sorted(code for code, _ in expect.values())

    # --validate-only finds the same problems without building an engine.
    import overnight.build as builder

    def no_engine(*a, **k):
        raise AssertionError("--validate-only must not load the model")

    monkeypatch.setattr(builder, "build_engine", no_engine)
    capsys.readouterr()
    report = tmp_path / "validate.jsonl"
    assert (
        run_cli(
            [
                "-i",
                str(tmp_path / "in.jsonl"),
                "--validate-only",
                "--errors-file",
                str(report),
                "--summary-json",
                str(tmp_path / "v.json"),
                *engine_flags(batch_model),
            ]
        )
        == 1
    )
    found = {
        int(r["error"]["message"].split(":")[0].removeprefix("line ")): r["error"]["code"]
        for r in read_jsonl(report)
    }
    assert found == {n: code for n, (code, _) in expect.items()}
    summary = json.loads((tmp_path / "v.json").read_text())
    assert summary["ok"] == len(good) and summary["failed"] == len(bad)
    assert "invalid_json" in capsys.readouterr().err
    good_only = tmp_path / "good.jsonl"
    write_jsonl(good_only, [chat_line("a", "w7", max_tokens=1), completion_line("b", ["w8", "w9"])])
    assert run_cli(["-i", str(good_only), "--validate-only", *engine_flags(batch_model)]) == 0


# ---- resume, overwrite, order, stdin/stdout ----------------------------------------------------


def test_resume_drops_a_torn_line_and_answers_the_rest_once(batch_model, tmp_path):
    lines = mixed_lines(40, seed=3)
    lines.insert(5, "not json")  # a failure without a custom_id must not be reported twice either
    write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    args = ["-i", str(tmp_path / "in.jsonl"), "-o", str(out), *engine_flags(batch_model)]
    assert run_cli(args) == 0
    full = out.read_bytes().splitlines(keepends=True)
    assert len(full) == 41
    out.write_bytes(b"".join(full[:17]) + full[17][: len(full[17]) // 2])  # a crash mid-line

    assert run_cli(args) == 2  # a non-empty output is never overwritten by accident
    assert out.read_bytes().endswith(full[17][: len(full[17]) // 2])
    assert run_cli([*args, "--resume", "--summary-json", str(tmp_path / "s.json")]) == 0
    data = out.read_bytes()
    assert data.endswith(b"\n")
    results = [json.loads(x) for x in data.splitlines()]  # every line whole
    ids = [r["custom_id"] for r in results]
    expected = [x["custom_id"] for x in lines if isinstance(x, dict)]
    assert sorted(i for i in ids if i is not None) == sorted(expected)
    assert ids.count(None) == 1
    assert data.startswith(b"".join(full[:17]))  # what was there stays
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["skipped"] == 17 and summary["ok"] + summary["failed"] == 41 - 17

    assert run_cli([*args, "--resume"]) == 0  # nothing left to do
    assert out.read_bytes() == data
    assert run_cli([*args, "--overwrite"]) == 0
    assert len(read_jsonl(out)) == 41


def test_order_input_and_order_completion(batch_model, tmp_path):
    # One long line first, then short ones: in completion order the long one comes last; in input
    # order the short ones wait in the spill, which is gone once the run completes.
    lines = [completion_line("long", "w9", max_tokens=40, ignore_eos=True, temperature=0)]
    lines += [completion_line(f"s{i}", f"w{10 + i}", max_tokens=1) for i in range(20)]
    write_jsonl(tmp_path / "in.jsonl", lines)
    ids = [x["custom_id"] for x in lines]
    flags = engine_flags(batch_model, max_num_seqs=4)
    for order in ("input", "completion"):
        out = tmp_path / f"{order}.jsonl"
        summary = tmp_path / f"{order}.json"
        args = ["-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--order", order, *flags]
        assert run_cli([*args, "--schedule", "fifo", "--summary-json", str(summary)]) == 0
        got = [r["custom_id"] for r in read_jsonl(out)]
        assert sorted(got) == sorted(ids)
        spilled = json.loads(summary.read_text())["schedule"]["spilled_lines"]
        if order == "input":
            assert got == ids
            assert spilled >= 10  # the short lines finished while the long one ran
        else:
            assert got[-1] == "long" and spilled == 0
        assert not (tmp_path / f"{order}.jsonl.spill").exists()
    long = read_jsonl(tmp_path / "input.jsonl")[0]["response"]["body"]
    assert long["usage"]["completion_tokens"] == 40 and long["choices"][0]["finish_reason"] == "length"


def test_stdin_to_stdout_in_a_subprocess(batch_model, tmp_path):
    lines = [
        chat_line("a", "w7 w8", max_tokens=3, temperature=0),
        "{broken",
        completion_line("b", ["w9", "w10 w11"], max_tokens=2, temperature=0),
    ]
    data = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()
    proc = run_subprocess(["-i", "-", "-o", "-", *engine_flags(batch_model)], input=data, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    results = [json.loads(x) for x in proc.stdout.decode().splitlines()]
    assert [r["custom_id"] for r in results] == ["a", None, "b"]
    assert results[1]["error"]["code"] == "invalid_json"
    assert len(results[2]["response"]["body"]["choices"]) == 2
    assert b"run-batch completed: 2 ok, 1 failed" in proc.stderr


# ---- pieces ------------------------------------------------------------------------------------


def test_output_order_spills_what_waits(tmp_path):
    from overnight.batch.ordering import OutputOrder
    from overnight.batch.spill import Spill

    spill = Spill(str(tmp_path / "out.jsonl.spill"))
    order = OutputOrder("input", spill)
    a, b, c = order.start(), order.start(), order.start()
    assert order.finish(c, {"x": "c"}) == [] and order.finish(b, {"x": "b"}) == []
    assert order.num_held == 2 and spill.num_appended == 2  # on disk, not in memory
    assert len((tmp_path / "out.jsonl.spill").read_bytes().splitlines()) == 2
    assert order.finish(a, {"x": "a"}) == [{"x": "a"}, {"x": "b"}, {"x": "c"}]
    assert order.num_held == 0
    order.start()
    e = order.start()
    assert order.finish(e, {"x": "e"}) == []
    assert order.close(completed=False) == []  # a durable spill keeps e for --resume
    assert (tmp_path / "out.jsonl.spill").exists()

    anonymous = OutputOrder("input")  # output to stdout: written out of order when interrupted
    anonymous.start()
    g = anonymous.start()
    assert anonymous.finish(g, {"x": "g"}) == [] and anonymous.close(completed=False) == [{"x": "g"}]
    fast = OutputOrder("completion", Spill(str(tmp_path / "fast.spill")))
    fast.start()
    h = fast.start()
    assert fast.finish(h, {"x": "h"}) == [{"x": "h"}]
    assert fast.close(completed=True) == [] and not (tmp_path / "fast.spill").exists()


def test_repair_and_scan(tmp_path):
    from overnight.batch.output import repair_and_scan

    path = tmp_path / "out.jsonl"
    records = [
        {"custom_id": "a", "error": None},
        {"custom_id": None, "error": {"code": "invalid_json", "message": "line 7: not valid JSON"}},
        {"custom_id": "a", "error": {"code": "duplicate_custom_id", "message": "line 9: custom_id 'a' ..."}},
        {"custom_id": "b", "error": {"code": "invalid_request", "message": "line 3: ..."}},
    ]
    body = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(body + b'{"custom_id": "c", "resp')
    answered = repair_and_scan(str(path))
    assert path.read_bytes() == body
    assert answered.custom_ids == {"a", "b"} and answered.lines == {7, 9}
    assert answered.num_records == 4 and answered.num_failures == 3 and answered.torn_bytes == 24
    path.write_bytes(b'{"custom_id": "only-torn"')
    assert repair_and_scan(str(path)).num_records == 0 and path.read_bytes() == b""


def test_runner_bounds_work_in_flight(batch_model):
    """Whatever the file size, the engine holds at most max_in_flight sequences (plus one line's worth)
    and the look-ahead window at most `window` lines read but not submitted."""
    import io

    from overnight import LLM
    from overnight.batch.ordering import OutputOrder
    from overnight.batch.output import Sink
    from overnight.batch.reader import read_lines
    from overnight.batch.runner import BatchRunner
    from overnight.batch.summary import Summary
    from overnight.entrypoints.submission import LookaheadOrder

    engine = LLM(
        batch_model,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        kv_cache_memory_bytes=8 << 20,
        device="cpu",
        dtype="float32",
        attention_backend="torch",
    ).engine
    rng = random.Random(1)
    lines = [
        completion_line(
            f"x{i}",
            [words(rng, 2)] * (1 + i % 2),
            n=1 + i % 3,
            max_tokens=rng.randint(1, 12),
            ignore_eos=True,
        )
        for i in range(120)
    ]
    raw = [json.dumps(x).encode() + b"\n" for x in lines]
    peak = {"seqs": 0, "waiting": 0}
    schedule = LookaheadOrder(window=10, block_size=16)
    add = engine.add_request

    def counting_add(*args, **kwargs):
        add(*args, **kwargs)
        running = sum(len(kids) for kids in engine.children.values())
        peak["seqs"] = max(peak["seqs"], running)
        peak["waiting"] = max(peak["waiting"], len(schedule))

    engine.add_request = counting_add
    out = io.BytesIO()
    out.close = lambda: None
    summary = Summary(input="-", output="-")
    BatchRunner(
        engine,
        Sink(out),
        summary,
        model_name=SERVED,
        names={SERVED},
        order=OutputOrder("input"),
        max_in_flight=8,
        schedule=schedule,
    ).run(read_lines(raw))
    results = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]
    assert summary.ok == 120
    assert peak["seqs"] <= 8 + 2 * 3 - 1  # the limit, exceeded by at most one line's sequences
    assert peak["waiting"] <= 10
    assert not engine.has_unfinished_requests() and not engine.parents


def test_resume_takes_live_answers_from_the_spill(batch_model, tmp_path, capsys):
    """What --resume does with out.jsonl.spill: a success the output lacks is placed from it in input
    order; one the output has (stale), a failure and a torn last line are ignored. Without --resume a
    spill with lines in it is refused; --overwrite removes it."""
    lines = [completion_line(c, f"w{10 + i} w20", max_tokens=3, temperature=0) for i, c in enumerate("abcd")]
    inp, out, spill = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "out.jsonl.spill"
    write_jsonl(inp, lines)
    flags = [*engine_flags(batch_model), "--schedule", "fifo"]
    assert run_cli(["-i", str(inp), "-o", str(out), *flags]) == 0
    full = read_jsonl(out)
    first = json.dumps(full[0]) + "\n"
    spilled_c = {**full[2], "id": "batch_req_from_spill"}
    stale_a = {**full[0], "id": "batch_req_stale"}
    failed_d = {**full[3], "id": "batch_req_failed", "error": {"code": "x", "message": "line 4: x"}}
    spill_text = "".join(json.dumps(r) + "\n" for r in (stale_a, spilled_c, failed_d))

    out.write_text("")
    spill.write_text(spill_text)
    capsys.readouterr()
    assert run_cli(["-i", str(inp), "-o", str(out), *flags]) == 2
    assert "pass --resume" in capsys.readouterr().err and spill.read_text() == spill_text

    out.write_text(first)
    spill.write_text(spill_text + '{"id": "batch_req_torn", "custom_id": "b", "resp')
    summary = tmp_path / "s.json"
    assert run_cli(["-i", str(inp), "-o", str(out), "--resume", "--summary-json", str(summary), *flags]) == 0
    got = read_jsonl(out)
    assert [r["custom_id"] for r in got] == ["a", "b", "c", "d"]
    assert [r["id"] for r in got][::2] == [full[0]["id"], "batch_req_from_spill"]
    assert got[1]["id"] != full[1]["id"] and got[3]["error"] is None  # computed again
    assert [r["response"]["body"]["choices"] for r in got] == [r["response"]["body"]["choices"] for r in full]
    s = json.loads(summary.read_text())
    assert (s["skipped"], s["recovered_from_spill"], s["ok"]) == (1, 1, 2)
    assert not spill.exists()

    spill.write_text(spill_text)
    assert run_cli(["-i", str(inp), "-o", str(out), "--overwrite", *flags]) == 0
    assert len(read_jsonl(out)) == 4 and not spill.exists()
