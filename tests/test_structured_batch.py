"""run-batch with structured outputs on the default model (SmolLM2, CPU): 200 lines over 4 JSON schemas,
given every way a batch line can (response_format json_schema, structured_outputs, guided_json), chat and
completions, greedy and seeded; regex, choice and json_object lines; and bad lines (invalid schema,
invalid regex, two constraints at once, an unsupported keyword) that fail alone. Every output parses and
validates (jsonschema); --validate-only finds the same bad lines without loading the weights."""

from __future__ import annotations

import json
import re

import pytest

from tests.batch_helpers import read_jsonl, run_subprocess, write_jsonl
from tests.structured_schemas import SCHEMAS, assert_valid

pytestmark = pytest.mark.slow  # runs the real model over batch files

NUM_SCHEMA_LINES = 200
REGEX = r"[A-Z]{2}-[0-9]{4}"
CHOICES = ["red", "green", "blue"]
FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--device", "cpu", "--no-progress"]


def schema_line(i: int) -> tuple[dict, str]:
    """Line i: (the batch line, the name of its schema)."""
    name = list(SCHEMAS)[i % len(SCHEMAS)]
    schema = SCHEMAS[name]
    sampling = {"temperature": 0.0} if i % 3 else {"temperature": 0.8, "seed": i}
    body: dict = {"max_tokens": 110, **sampling}
    way = (i // len(SCHEMAS)) % 3
    if way == 0:
        url = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"Make up {name} number {i} as JSON."}]
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        }
    elif way == 1:
        url = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"A {name}, please (#{i})."}]
        body["structured_outputs"] = {"json": schema}
    else:
        url = "/v1/completions"
        body["prompt"] = f"Here is {name} record {i} in JSON:"
        body["guided_json"] = json.dumps(schema)
    return {"custom_id": f"{name}-{i}", "method": "POST", "url": url, "body": body}, name


def other_lines() -> list[dict]:
    def chat(cid: str, content: str, **extra) -> dict:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 30, "temperature": 0.0}
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {**body, **extra}}

    lines = []
    for i in range(6):
        lines.append(chat(f"regex-{i}", f"Give me ticket code {i}.", guided_regex=REGEX))
        lines.append(chat(f"choice-{i}", f"Pick a colour for item {i}.", guided_choice=CHOICES))
    for i in range(3):
        lines.append(
            chat(
                f"object-{i}",
                "Give me a JSON object with a name and an age.",
                response_format={"type": "json_object"},
                max_tokens=60,
            )
        )
    lines += [
        chat(
            "bad-schema", "x", response_format={"type": "json_schema", "json_schema": {"schema": {"type": 7}}}
        ),
        chat("bad-regex", "x", guided_regex="([a-z]"),
        chat("two-kinds", "x", guided_regex="a", response_format={"type": "json_object"}),
        chat("unsupported", "x", guided_json={"type": "array", "items": {"type": "integer"}, "contains": {}}),
    ]
    return lines


BAD = {
    "bad-schema": "JSON schema cannot be compiled",
    "bad-regex": "regex cannot be compiled",
    "two-kinds": "only one structured output constraint",
    "unsupported": "'contains' at /",
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured-batch")
    schema_lines = [schema_line(i) for i in range(NUM_SCHEMA_LINES)]
    lines = [line for line, _ in schema_lines] + other_lines()
    inp, out = tmp / "in.jsonl", tmp / "out.jsonl"
    write_jsonl(inp, lines)
    proc = run_subprocess(["-i", str(inp), "-o", str(out), *FLAGS], timeout=1500)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]  # failed lines are error lines
    return (
        {r["custom_id"]: r for r in read_jsonl(out)},
        dict((line["custom_id"], name) for line, name in schema_lines),
        inp,
    )


def content(record: dict) -> str:
    choice = record["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_every_schema_line_parses_and_validates(batch):
    records, names, _ = batch
    assert len(records) == NUM_SCHEMA_LINES + len(other_lines())
    for cid, name in names.items():
        record = records[cid]
        assert record["error"] is None, record["error"]
        assert record["response"]["status_code"] == 200
        assert_valid(content(record), SCHEMAS[name])
        assert record["response"]["body"]["choices"][0]["finish_reason"] == "stop"


def test_regex_choice_and_object_lines(batch):
    records, _, _ = batch
    for i in range(6):
        assert re.fullmatch(REGEX, content(records[f"regex-{i}"]))
        assert content(records[f"choice-{i}"]) in CHOICES
    for i in range(3):
        assert isinstance(json.loads(content(records[f"object-{i}"])), dict)
    for cid in [f"{kind}-{i}" for kind in ("regex", "choice", "object") for i in range(3)]:
        assert records[cid]["response"]["body"]["choices"][0]["finish_reason"] == "stop"


def test_bad_lines_fail_alone_with_the_reason(batch):
    records, _, inp = batch
    for cid, words in BAD.items():
        err = records[cid]["error"]
        assert records[cid]["response"]["status_code"] == 400
        assert err["code"] == "invalid_request" and words in err["message"], err
    # --validate-only reads the tokenizer, compiles the grammars, and names the same lines.
    proc = run_subprocess(["-i", str(inp), "--validate-only", *FLAGS], timeout=300)
    report = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode == 1, report[-2000:]
    assert f"{len(records) - len(BAD)} valid, {len(BAD)} invalid" in report
