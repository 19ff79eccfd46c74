"""Engine, server and sampling options are checked when they are made (options.check_options): a wrong
value is refused by name, in well under a second, before a model is resolved or a weight loads (the
default model takes about 2.5 s to load on the CPU, so the elapsed time tells)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import overnight.batch.cli
import overnight.build
import overnight.entrypoints.generate_cli
import overnight.entrypoints.llm
import overnight.tools.budget  # noqa: F401  (imported here, so the commands' timing is theirs alone)
from overnight import LLM, SamplingParams
from overnight.cli import main
from overnight.errors import ConfigError, InvalidRequestError
from overnight.options import EngineOptions
from overnight.server.cli import ServerOptions

# One wrong value per kind of check: choices, minimum (positivity), fraction, type, pattern.
WRONG = [
    ("attention_backend", "trition", "one of auto, torch, triton"),
    ("schedule", "sjf", "one of lookahead, fifo"),
    ("load_format", "pickle", "one of auto, safetensors, gguf, dummy"),
    ("max_num_seqs", 0, "at least 1"),
    ("max_num_batched_tokens", -5, "at least 1"),
    ("max_model_len", 1, "at least 2"),
    ("gpu_memory_utilization", 1.5, "fraction in (0, 1]"),
    ("gpu_memory_utilization", 0.0, "fraction in (0, 1]"),
    ("enforce_eager", "yes", "true or false"),
    ("max_num_seqs", 2.5, "an integer"),
    ("device", "gpu", "cpu|cuda"),
]


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything reaches the model: resolving it or building an engine."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was resolved before the options were checked")

    monkeypatch.setattr(overnight.entrypoints.llm, "build_engine", refuse)
    monkeypatch.setattr(overnight.build, "resolve_model", refuse)


@pytest.mark.parametrize(("name", "value", "says"), WRONG, ids=[f"{n}={v!r}" for n, v, _ in WRONG])
def test_llm_refuses_a_wrong_value_by_name_before_loading(no_loading, name, value, says):
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=name) as e:
        LLM(**{name: value})  # the default model: loading it would take seconds
    assert time.perf_counter() - start < 0.5
    assert says in str(e.value)


def test_the_spellings_users_pass_are_stored_as_the_option_names_them():
    import torch

    assert EngineOptions(pooling_type="mean").pooling_type == "MEAN"
    assert EngineOptions(dtype=torch.float16).dtype == "float16"  # as vLLM takes it
    assert EngineOptions(dtype="torch.bfloat16").dtype == "bfloat16"
    assert EngineOptions(device=torch.device("cuda", 1)).device == "cuda:1"
    assert EngineOptions(model=Path("/some/folder")).model == "/some/folder"
    assert EngineOptions(gpu_memory_utilization=1).gpu_memory_utilization == 1
    assert EngineOptions(device="cuda:1", max_num_seqs=1, seed=0).device == "cuda:1"


@pytest.mark.parametrize(
    ("command", "flags", "says"),
    [
        (["generate", "hello"], ["--max-num-seqs", "0"], "max_num_seqs must be at least 1"),
        (["run-batch", "-i", "README.md", "-o", "-"], ["--gpu-memory-utilization", "1.5"], "fraction"),
        (["serve"], ["--max-num-batched-tokens", "-5"], "max_num_batched_tokens"),
        (["serve"], ["--stream-interval", "0"], "stream_interval must be at least 1"),
        (["budget"], ["--block-size", "0"], "block_size must be at least 1"),
    ],
    ids=["generate", "run-batch", "serve-engine", "serve-server", "budget"],
)
def test_commands_refuse_a_wrong_value_by_name_before_loading(no_loading, capsys, command, flags, says):
    start = time.perf_counter()
    assert main([*command, *flags]) == 2
    assert time.perf_counter() - start < 0.5
    assert says in capsys.readouterr().err.strip().splitlines()[-1]


def test_server_options_are_checked():
    with pytest.raises(ConfigError, match="max_request_bytes must be at least 1"):
        ServerOptions(max_request_bytes=0)
    with pytest.raises(ConfigError, match="port must be an integer"):
        ServerOptions(port="8000")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"max_tokens": -1}, "max_tokens"),
    ],
)
def test_sampling_params_refuse_a_wrong_value_by_name(kwargs, name):
    with pytest.raises(InvalidRequestError, match=f"^{name} must"):
        SamplingParams(**kwargs)


def test_trust_remote_code_is_an_option_like_vllms():
    from overnight.options import EngineOptions

    assert EngineOptions.from_kwargs(model="m", trust_remote_code=True).trust_remote_code is True


def test_each_list_of_allowed_values_is_declared_once():
    """No module spells out an option's choices again (options.py is the one place; others import)."""
    import ast
    from dataclasses import fields
    from pathlib import Path

    import overnight

    choices = {f.metadata["choices"] for f in fields(EngineOptions) if f.metadata["choices"]}
    root = Path(overnight.__file__).parent
    again = []
    for path in root.rglob("*.py"):
        if path.name == "options.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple) and all(isinstance(e, ast.Constant) for e in node.elts):
                if tuple(e.value for e in node.elts) in choices:
                    again.append(f"{path.relative_to(root)}:{node.lineno}")
    assert again == []
