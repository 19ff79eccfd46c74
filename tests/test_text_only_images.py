"""Text-only mode of image models (limit_mm_per_prompt image 0, ModelArch.text_only): for each image
family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, Gemma 3, Mistral 3, InternVL, Llama 4, Idefics3, GLM-4.1V /
4.5V, on the tiny random checkpoints of their own tests) the model is built without its tower and projector,
the checkpoint's tower tensors are not read,
no encoder step is set up, text prompts give the same greedy tokens as the full model (chunked prefill
and decode), and an image prompt is refused naming the limit; the budget counts fewer weight bytes and
a larger pool, and the weight-fit check passes the decoder alone; in run-batch only the image line fails."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from overnight import LLM, SamplingParams
from overnight.models.vision.interface import TOWER_CHECKPOINT_PREFIXES
from tests.tiny_gemma_vl import make_gemma_vl_checkpoint
from tests.tiny_glm4v import make_glm4v_checkpoint
from tests.tiny_internvl import make_internvl_checkpoint
from tests.tiny_llama4_vl import make_llama4_vl_checkpoint
from tests.tiny_mistral3_vl import make_mistral3_vl_checkpoint
from tests.tiny_smolvlm import make_smolvlm_checkpoint
from tests.tiny_vl import data_uri, image, make_vl_checkpoint

MAKERS: dict[str, Callable[[Any], str]] = {
    "qwen2_vl": lambda root: make_vl_checkpoint(root, "qwen2_vl"),
    "qwen2_5_vl": lambda root: make_vl_checkpoint(root, "qwen2_5_vl"),
    "qwen3_vl": lambda root: make_vl_checkpoint(root, "qwen3_vl"),
    "qwen3_5": lambda root: make_vl_checkpoint(root, "qwen3_5"),
    "gemma3": make_gemma_vl_checkpoint,
    "mistral3": make_mistral3_vl_checkpoint,
    "internvl": make_internvl_checkpoint,
    "llama4": make_llama4_vl_checkpoint,
    "idefics3": make_smolvlm_checkpoint,
    "glm4v": make_glm4v_checkpoint,
    "glm4v_moe": lambda root: make_glm4v_checkpoint(root, moe=True),
}
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
ENGINE = dict(
    dtype="float32",
    kv_cache_memory_bytes=8 << 20,
    max_model_len=256,
    max_num_batched_tokens=16,
    max_num_seqs=4,
)
# Word tokens of every tiny vocabulary (their special tokens sit below 12); the longest prompt spans
# three prefill chunks.
PROMPTS = [list(range(30, 37)), list(range(40, 80)), [50 + (7 * i) % 150 for i in range(23)]]
REFUSAL = "limit_mm_per_prompt image 0"


def _model(llm: LLM) -> Any:
    return llm.engine.runner.model  # type: ignore[attr-defined]


def _tower_params(model: Any) -> int:
    bare = tuple(p.removeprefix("model.") for p in TOWER_CHECKPOINT_PREFIXES)
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(bare))


@pytest.mark.parametrize("family", list(MAKERS))
def test_text_only_is_the_full_model_without_its_tower(family, tmp_path, monkeypatch):
    folder = MAKERS[family](tmp_path)
    full = LLM(folder, **ENGINE)
    read: list[str] = []
    from overnight.loader import hf

    iter_safetensors = hf.iter_safetensors

    def recording(*args, **kwargs):
        for name, tensor in iter_safetensors(*args, **kwargs):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr("overnight.loader.model_loader.iter_safetensors", recording)
    text = LLM(folder, limit_mm_per_prompt={"image": 0}, **ENGINE)  # as vLLM users pass it

    # The tower's tensors were never read, and the model holds none of its parameters.
    assert read and not any(n.startswith(TOWER_CHECKPOINT_PREFIXES) for n in read)
    tower = sum(t.numel() for n, t in iter_safetensors(folder) if n.startswith(TOWER_CHECKPOINT_PREFIXES))
    # loaded, at least the checkpoint's (a tower's MLP may be padded wider: qwen_vit.SwiGLU.after_load_)
    assert tower > 0 and _tower_params(_model(full)) >= tower and _tower_params(_model(text)) == 0
    assert text.engine.runner.vision is None and full.engine.runner.vision is not None  # type: ignore[attr-defined]
    whole, bare = _model(full).arch, _model(text).arch
    assert bare.text_only and whole.num_parameters() - bare.num_parameters() == tower

    prompts: list[Any] = [{"prompt_token_ids": ids} for ids in PROMPTS]
    want = [o.outputs[0].token_ids for o in full.generate(prompts, GREEDY, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in text.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want

    with pytest.raises(ValueError, match=REFUSAL):
        text.generate(
            {"prompt_token_ids": PROMPTS[0], "multi_modal_data": {"image": image(32, 32, 0)}},
            GREEDY,
            use_tqdm=False,
        )


def test_fit_check_and_budget_count_no_tower(tmp_path, monkeypatch):
    import torch

    from overnight.build import resolve_model
    from overnight.errors import ConfigError
    from overnight.loader import fit
    from overnight.options import EngineOptions
    from overnight.tools.budget import GIB, DeviceMemory, plan_budget, render

    folder = make_vl_checkpoint(tmp_path, "qwen3_vl")
    gpu = DeviceMemory("NVIDIA H200", total_bytes=int(139.8 * GIB), free_bytes=int(139.3 * GIB))

    def budget(**kw: Any) -> Any:
        opts = EngineOptions(model=folder, skip_tokenizer_init=True, max_model_len=256, **kw)
        source = resolve_model(opts).source
        return source, plan_budget(opts, source, gpu)

    source, b = budget()
    bare_source, bare = budget(limit_mm_per_prompt="0")
    assert source.arch.vision is not None and not source.arch.text_only and bare_source.arch.text_only
    tower = source.arch.vision.num_parameters() * 2  # bfloat16 on the GPU
    assert b.weights_bytes is not None and bare.weights_bytes is not None
    assert b.weights_bytes - bare.weights_bytes == tower
    assert bare.budget_bytes - b.budget_bytes == tower and bare.num_blocks >= b.num_blocks
    assert "text-only" in render(bare, "m", bare_source.arch, "bfloat16")
    assert "text-only" not in render(b, "m", source.arch, "bfloat16")

    # The weight-fit check: memory for the decoder but not the tower stops only the full model.
    cpu = torch.device("cpu")
    text_bytes = fit.weight_bytes(bare_source.arch, torch.float32)
    assert fit.weight_bytes(source.arch, torch.float32) - text_bytes == 2 * tower
    monkeypatch.setattr(fit, "available_memory_bytes", lambda device: text_bytes)
    fit.check_weights_fit(bare_source.arch, torch.float32, cpu, "m")
    with pytest.raises(ConfigError, match="does not fit"):
        fit.check_weights_fit(source.arch, torch.float32, cpu, "m")


def test_bad_limits_are_refused_before_loading():
    from overnight.errors import ConfigError
    from overnight.options import EngineOptions, image_limit

    assert EngineOptions(limit_mm_per_prompt={"image": 0, "video": 0}).limit_mm_per_prompt == (  # type: ignore[arg-type]
        '{"image": 0, "video": 0}'
    )
    assert image_limit(EngineOptions(limit_mm_per_prompt=3).limit_mm_per_prompt) == 3  # type: ignore[arg-type]
    for bad in ("-1", "two", '{"image": -2}', '{"image": "x"}'):
        with pytest.raises(ConfigError, match="limit_mm_per_prompt"):
            EngineOptions(limit_mm_per_prompt=bad)


def test_run_batch_fails_only_the_image_line(tmp_path):
    from overnight.cli import main
    from tests.batch_helpers import chat_line, read_jsonl, write_jsonl
    from tests.tiny_vl import cpu_flags, words

    folder = make_vl_checkpoint(tmp_path / "m", "qwen3_vl")
    picture = {"type": "image_url", "image_url": {"url": data_uri(image(32, 32, 1))}}
    lines = [
        chat_line("text", words(5, 1), max_tokens=3, temperature=0),
        chat_line("image", [picture, {"type": "text", "text": words(3, 2)}], max_tokens=3),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    flags = [*cpu_flags(folder), "--max-model-len", "256", "--no-progress", "--limit-mm-per-prompt", "0"]
    assert main(["run-batch", "-i", str(inp), "-o", str(out), *flags]) == 0
    records = {r["custom_id"]: r for r in read_jsonl(out)}
    assert records["text"]["error"] is None and records["text"]["response"]["status_code"] == 200
    assert records["image"]["response"]["status_code"] == 400
    assert REFUSAL in records["image"]["error"]["message"]
