"""Schema-driven fuzzing: request bodies drawn (with hypothesis) from the JSON schemas the server publishes
at /openapi.json, then bent: fields of the wrong type, values past their bounds, required fields dropped,
unknown fields, bodies that are not objects or not JSON. Whatever arrives, the answer is never a 5xx,
every error is an OpenAI error object, every stream is well-formed SSE, and the server keeps serving.

The model is a tiny random Llama with SmolLM2's vocabulary and tokenizer (chat template included), so
the valid cases that do generate (up to n=128 samples of up to max_model_len tokens) cost milliseconds.
"""

from __future__ import annotations

import json
import string
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overnight.build import build_engine
from overnight.loader.resolve import default_gguf_path
from overnight.options import EngineOptions
from overnight.server.background import BackgroundServer
from overnight.server.cli import ServerOptions, make_app
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # fuzzes a live server

ROUTES = ("/v1/chat/completions", "/v1/completions")
MAX_EXAMPLES = 300

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
ANY_JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
# Lone surrogates are legal in JSON ("\ud800") but not in UTF-8: the tokenizer must not turn them into a 500.
TEXT = st.text(alphabet=string.printable + "éü中😀\x00\ud800\udfff", max_size=40)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_checkpoint(
        tmp_path_factory.mktemp("fuzz"), "llama", vocab_size=49152, eos_token_ids=[2]
    )
    engine = build_engine(
        EngineOptions(
            model=str(folder),
            tokenizer=default_gguf_path(),
            mode="server",
            max_model_len=64,
            served_model_name="tiny",
        )
    )
    with BackgroundServer(make_app(engine, ServerOptions())) as s:
        yield s


class SchemaStrategies:
    """JSON-schema (the subset pydantic emits) -> hypothesis strategy of instances that mostly conform.

    `fields` replaces the strategy of named properties: the fuzz keeps n small, because n=100 samples of a
    full context are valid but cost seconds each, and the point here is the parsing, not the batching."""

    def __init__(
        self,
        components: dict[str, Any],
        fields: dict[str, st.SearchStrategy] | None = None,
        always: frozenset[str] = frozenset(),
    ) -> None:
        self.components = components
        self.fields = fields or {}
        self.always = always  # optional properties drawn like required ones

    def instance(self, schema: dict[str, Any]) -> st.SearchStrategy:
        if "$ref" in schema:
            return st.deferred(lambda: self.instance(self.components[schema["$ref"].rsplit("/", 1)[-1]]))
        if "anyOf" in schema:
            return st.one_of([self.instance(s) for s in schema["anyOf"]])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        kind = schema.get("type")
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            return st.lists(
                self.instance(schema.get("items", {})),
                min_size=schema.get("minItems", 0),
                max_size=max(schema.get("minItems", 0), 4),
            )
        if kind == "integer":
            return st.integers(schema.get("minimum"), schema.get("maximum"))
        if kind == "number":
            lo = schema.get("minimum", schema.get("exclusiveMinimum"))
            return st.floats(
                lo,
                schema.get("maximum"),
                allow_nan=False,
                allow_infinity=False,
                exclude_min="exclusiveMinimum" in schema,
            )
        if kind == "string":
            return TEXT
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        return ANY_JSON

    def _object(self, schema: dict[str, Any]) -> st.SearchStrategy:
        props: dict[str, Any] = schema.get("properties", {})
        if not props:
            # Free-form objects: content parts and chat_template_kwargs; keys that mean something there.
            keys = st.sampled_from(
                [
                    "type",
                    "text",
                    "x",
                    "chat_template",
                    "conversation",
                    "tokenize",
                    "add_generation_prompt",
                    "messages",
                ]
            )
            return st.dictionaries(keys, ANY_JSON | TEXT, max_size=3)
        required = set(schema.get("required", [])) | (self.always & set(props))

        @st.composite
        def build(draw: st.DrawFn) -> dict[str, Any]:
            out = {}
            for name, sub in props.items():
                if name in required or draw(st.integers(0, 3)) == 0:  # optional fields: one in four
                    out[name] = draw(self.fields[name] if name in self.fields else self.instance(sub))
            return out

        return build()


@st.composite
def bent(draw: st.DrawFn, body: Any) -> Any:
    """A conforming body, or one broken in one of the ways clients break them."""
    how = draw(st.sampled_from(["as is"] * 5 + ["wrong value", "drop field", "extra field", "not an object"]))
    if how == "not an object" or not isinstance(body, dict):
        return draw(ANY_JSON)
    body = dict(body)
    if how == "wrong value" and body:
        body[draw(st.sampled_from(sorted(body)))] = draw(ANY_JSON)
    elif how == "drop field" and body:
        body.pop(draw(st.sampled_from(sorted(body))))
    elif how == "extra field":
        body[draw(st.text(max_size=8))] = draw(ANY_JSON)
    return body


def check_error(r: httpx.Response) -> None:
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, r.text
    assert isinstance(error["message"], str) and error["message"]


def check_stream(r: httpx.Response) -> None:
    events = [line for line in r.text.split("\n\n") if line.strip()]
    assert events[-1] == "data: [DONE]", r.text[-300:]
    for event in events[:-1]:
        assert event.startswith("data: "), event
        chunk = json.loads(event[len("data: ") :])
        assert "error" not in chunk, chunk  # a mid-stream error would mean the engine failed
        assert isinstance(chunk["choices"], list)


def test_fuzz_openapi_bodies_never_5xx(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        spec = http.get("/openapi.json").json()
        n = st.integers(1, 3) | st.sampled_from([0, 129, -1, 1.5, "2", None])
        # Lengths and token ids drawn where they are mostly valid (max_tokens past this 64-token context
        # is a 400, ids past the vocabulary too), with the values that must be refused mixed in.
        length = st.integers(1, 8) | st.sampled_from([0, -1, 10**9, 1.5, "2", None])
        token_id = st.integers(0, 49151)
        fields = {
            "n": n,
            "best_of": st.integers(1, 3) | st.sampled_from([0, 129, "2", None]),
            "max_tokens": length,
            "max_completion_tokens": length,
            "truncate_prompt_tokens": length,
            "allowed_token_ids": st.lists(token_id, min_size=1, max_size=4)
            | st.sampled_from([[], [-1], [10**9], "x", None]),
            "logit_bias": st.dictionaries(token_id.map(str), st.floats(-100, 100), max_size=3)
            | st.sampled_from([{"x": 1}, {"1": 101}, {"-1": 0}, [], None]),
            # Structured outputs: mostly unset or valid (a second constraint is a 400), a few broken.
            "response_format": st.sampled_from(
                [
                    None,
                    None,
                    {"type": "text"},
                    {"type": "json_object"},
                    {"type": "json_schema"},
                    {"type": "x"},
                ]
            ),
            "structured_outputs": st.sampled_from([None] * 4 + [{"choice": ["a", "b"]}, {"regex": "("}]),
            "guided_json": st.sampled_from([None] * 4 + [{"type": "object"}, "{not json"]),
            "guided_regex": st.sampled_from([None] * 4 + ["[a-z]{1,3}", "("]),
            "guided_choice": st.sampled_from([None] * 4 + [["yes", "no"], []]),
            "guided_grammar": st.sampled_from([None] * 4 + ['root ::= "a"', "root ::="]),
            "guided_whitespace_pattern": st.sampled_from([None] * 5 + [" *"]),
            "stream_options": st.sampled_from([None] * 3 + [{"include_usage": True}]),
            "stop": st.sampled_from([None, "\n", ["a", "b"], "", [""]]),
        }
        # A message's content is optional only for the assistant: drawn always (dropped by `bent`).
        schemas = SchemaStrategies(spec["components"]["schemas"], fields, always=frozenset({"content"}))
        bodies = {}
        for route in ROUTES:
            ref = spec["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
            bodies[route] = schemas.instance(ref)
        extras = st.fixed_dictionaries(
            {},
            optional={
                "n": st.integers(1, 3),
                "temperature": st.floats(0.0, 2.0),
                "seed": st.integers(0, 2**31),
                "logprobs": st.booleans(),
                "stream": st.booleans(),
                "guided_choice": st.just(["yes", "no"]),
                "response_format": st.just({"type": "json_object"}),
            },
        )
        text = st.text(alphabet=string.ascii_letters + " ", min_size=1, max_size=20)
        plain_bodies = {
            "/v1/chat/completions": st.builds(
                lambda content, k, more: {
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": k,
                    **{key: v for key, v in more.items() if key != "logprobs"},
                },
                text,
                st.integers(1, 8),
                extras,
            ),
            "/v1/completions": st.builds(
                lambda prompt, k, more: {
                    "prompt": prompt,
                    "max_tokens": k,
                    **{key: (1 if v else None) if key == "logprobs" else v for key, v in more.items()},
                },
                text,
                st.integers(1, 8),
                extras,
            ),
        }
        statuses: dict[int, int] = {}

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            route = data.draw(st.sampled_from(ROUTES))
            # A schema-drawn body sets a quarter of some forty optional fields, each now and then invalid,
            # so few of those generate; one body in four is a plain valid one with a few extras instead.
            drawn = data.draw(st.sampled_from([bodies, bodies, bodies, plain_bodies]))
            body = data.draw(bent(data.draw(drawn[route])))
            raw = data.draw(st.sampled_from([None] * 9 + [b"{", b"\xff\xfe", b"", b"[" * 5000]))
            content = raw if raw is not None else json.dumps(body).encode()
            r = http.post(route, content=content, headers={"Content-Type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body, r.text)
            if r.status_code != 200:
                check_error(r)
            elif r.headers["content-type"].startswith("text/event-stream"):
                check_stream(r)
            else:
                assert r.json()["choices"], r.text

        run()
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
    # The run covers both sides of validation, not only rejections.
    assert statuses.get(200, 0) >= MAX_EXAMPLES // 20, statuses
    assert statuses.get(400, 0) >= MAX_EXAMPLES // 10, statuses
