"""run-batch with --lora-modules: each line picks its adapter by the body's model (the served name, or
none, for the base model); a line naming an unknown adapter is that line's error and the others finish
with what LLM.generate gives for the same adapter; a bad adapter folder stops the run at start (exit 2)."""

from __future__ import annotations

import random

import pytest

from tests.lora_adapters import make_adapter
from tests.test_run_batch import (
    SERVED,
    VOCAB,
    completion_line,
    engine_flags,
    read_jsonl,
    run_cli,
    write_jsonl,
)

pytestmark = pytest.mark.slow  # runs the real model


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, batch_model_module):
    root = tmp_path_factory.mktemp("batch-lora")
    return {
        "sql": str(
            make_adapter(batch_model_module, root / "sql", r=8, targets=("q_proj", "v_proj", "down_proj"))
        ),
        "chat": str(
            make_adapter(batch_model_module, root / "chat", r=4, targets=("o_proj", "up_proj"), seed=3)
        ),
    }


@pytest.fixture(scope="module")
def batch_model_module(tmp_path_factory) -> str:
    from tests.batch_helpers import make_batch_model

    return make_batch_model(tmp_path_factory.mktemp("batch-model"))


def test_lines_pick_adapters_and_an_unknown_one_fails_alone(batch_model_module, adapters, tmp_path) -> None:
    from overnight import LLM, LoRARequest, SamplingParams

    rng = random.Random(0)
    models = ["sql", "chat", SERVED, None, "sql", "chat", "nope", None]
    lines, prompts = [], []
    for i, model in enumerate(models):
        ids = [rng.randrange(6, VOCAB) for _ in range(rng.randint(3, 20))]
        body = {"temperature": 0, "max_tokens": 6, **({"model": model} if model else {})}
        lines.append(completion_line(f"l{i}", ids, **body))
        prompts.append(ids)
    write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    flags = engine_flags(batch_model_module, max_num_seqs=4) + ["--max-loras", "1", "--max-lora-rank", "8"]
    modules = [f"{name}={path}" for name, path in adapters.items()]
    assert (
        run_cli(["-i", str(tmp_path / "in.jsonl"), "-o", str(out), *flags, "--lora-modules", *modules]) == 0
    )
    results = {r["custom_id"]: r for r in read_jsonl(out)}
    assert len(results) == len(lines)

    bad = results["l6"]
    assert bad["error"]["code"] == "model_not_found" and "'nope'" in bad["error"]["message"]
    assert bad["response"]["status_code"] == 404

    llm = LLM(
        batch_model_module, max_model_len=96, kv_cache_memory_bytes=8 << 20, device="cpu", dtype="float32",
        enable_lora=True, max_lora_rank=8, max_loras=2,
    )  # fmt: skip
    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}
    params = SamplingParams(temperature=0, max_tokens=6)
    for i, (model, ids) in enumerate(zip(models, prompts)):
        if model == "nope":
            continue
        lora = requests.get(model) if model else None
        want = llm.generate([ids], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
        body = results[f"l{i}"]["response"]["body"]
        assert body["choices"][0]["text"] == want, (i, model)
        assert body["model"] == (model if model in requests else SERVED)
        if lora is not None:  # the adapter changes the answer (the comparison above is not vacuous)
            base = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].text
            assert base != want


def test_bad_adapter_folder_stops_the_run(batch_model_module, tmp_path, capsys) -> None:
    folder = tmp_path / "big"
    make_adapter(batch_model_module, folder, r=32, targets=("q_proj",))
    write_jsonl(tmp_path / "in.jsonl", [completion_line("a", [5, 6], max_tokens=2, model="big")])
    code = run_cli(
        ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"), *engine_flags(batch_model_module),
         "--lora-modules", f"big={folder}"]
    )  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "LoRA adapter 'big'" in err and "rank r=32 exceeds max_lora_rank 16" in err


def test_validate_only_knows_the_adapter_names(batch_model_module, adapters, tmp_path) -> None:
    lines = [
        completion_line("ok", [5, 6], max_tokens=2, model="sql"),
        completion_line("bad", [5, 6], max_tokens=2, model="nope"),
    ]
    write_jsonl(tmp_path / "in.jsonl", lines)
    errors = tmp_path / "errors.jsonl"
    flags = [*engine_flags(batch_model_module), "--lora-modules", f"sql={adapters['sql']}"]
    code = run_cli(
        ["-i", str(tmp_path / "in.jsonl"), "--validate-only", "--errors-file", str(errors), *flags]
    )
    assert code == 1  # one line fails
    assert [r["custom_id"] for r in read_jsonl(errors)] == ["bad"]
