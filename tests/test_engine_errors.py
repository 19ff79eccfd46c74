"""Bad input: each a clear exception naming the problem; after per-request errors the engine serves."""

from __future__ import annotations

import json

import pytest

from overnight import LLM, InvalidRequestError, ModelLoadError, SamplingParams
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("errors"), "llama")


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        LLM(str(tmp_path / "no-such-model"))


def test_corrupt_safetensors(folder, tmp_path):
    bad = tmp_path / "corrupt"
    bad.mkdir()
    for f in folder.iterdir():
        data = f.read_bytes()
        (bad / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(bad), skip_tokenizer_init=True)


def test_unknown_architecture(folder, tmp_path):
    odd = tmp_path / "odd"
    odd.mkdir()
    for f in folder.iterdir():
        (odd / f.name).write_bytes(f.read_bytes())
    config = json.loads((odd / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    config["model_type"] = "mamba"
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="MambaForCausalLM|mamba"):
        LLM(str(odd), skip_tokenizer_init=True)


def test_pickle_checkpoint_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really")
    with pytest.raises(ModelLoadError, match="pickle"):
        LLM(str(tmp_path))


def test_per_request_errors_then_the_engine_still_serves(folder):
    llm = LLM(
        str(folder),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=64,
        kv_cache_memory_bytes=8 << 20,
    )
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": list(range(3, 100))}], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=0), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt 1"):
        llm.generate([[5, 6], [], [7]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], use_tqdm=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_chat_messages_follow_the_servers_rules():
    """LLM.chat renders through render_conversation: the roles and content the server accepts, no more."""
    from overnight.entrypoints.prompts import render_conversation

    for conv, needle in (
        ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
        ([{"role": "user", "content": None}], "needs content"),
        ([{"role": "user"}], "needs content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "text parts"),
        ([{"content": "x"}], '"role"'),
    ):
        with pytest.raises(InvalidRequestError, match=needle):
            render_conversation(conv, None)
    with pytest.raises(InvalidRequestError, match="tokenizer"):  # valid messages: only the tokenizer lacks
        render_conversation([{"role": "assistant", "content": None}, {"role": "user", "content": "x"}], None)
