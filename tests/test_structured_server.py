"""`overnight serve` with structured outputs, through the official `openai` client on the default model
(SmolLM2, CPU): response_format json_schema (also from a pydantic model with the client's parse()),
json_object streamed, vLLM's extra body fields on completions, and the 400s a bad constraint gets."""

from __future__ import annotations

import json
import re

import openai
import pytest
from pydantic import BaseModel, Field

from overnight import LLM
from overnight.server.background import BackgroundServer
from overnight.server.cli import ServerOptions, make_app
from tests.structured_schemas import SCHEMAS, assert_valid

pytestmark = pytest.mark.slow  # serves the real model


@pytest.fixture(scope="module")
def server():
    llm = LLM(mode="server", dtype="float32", max_model_len=512, max_num_seqs=8)
    with BackgroundServer(make_app(llm.engine, ServerOptions())) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_chat_json_schema(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Review a cafe as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "review", "schema": SCHEMAS["review"], "strict": True},
        },
        temperature=0,
        max_tokens=100,
    )
    assert r.choices[0].finish_reason == "stop"
    assert_valid(r.choices[0].message.content, SCHEMAS["review"])


class Pet(BaseModel):
    name: str = Field(max_length=12)
    species: str = Field(pattern="^(cat|dog|fish)$")
    legs: int = Field(ge=0, le=4)


def test_parse_with_a_pydantic_model(client, model):
    r = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe a pet."}],
        response_format=Pet,
        temperature=0,
        max_tokens=60,
    )
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 4 and pet.species in ("cat", "dog", "fish")


def test_json_object_streamed(client, model):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a JSON object with a name and an age."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


def test_completions_with_vllm_extra_fields(client, model):
    r = client.completions.create(
        model=model,
        prompt=["The sky is", "Grass is"],
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": ["blue", "green", "red"]},
    )
    assert [c.text for c in r.choices] == [c.text for c in r.choices if c.text in ("blue", "green", "red")]
    assert len(r.choices) == 2
    r = client.completions.create(
        model=model,
        prompt="Order number:",
        max_tokens=12,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r" #[0-9]{4}"}},
    )
    assert re.fullmatch(r" #[0-9]{4}", r.choices[0].text)


@pytest.mark.parametrize(
    "extra, words, param",
    [
        ({"guided_regex": "(unclosed"}, "regex cannot be compiled", None),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "strng"}}}},
            "Unsupported type",
            None,
        ),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "'uniqueItems' at /", None),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "only one structured output constraint",
            "guided_regex",
        ),
    ],
)
def test_bad_constraints_are_400s(client, model, extra, words, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4, extra_body=extra
        )
    err = info.value
    assert err.status_code == 400 and words in err.message
    assert err.body["code"] == "invalid_request" and err.body["param"] == param
