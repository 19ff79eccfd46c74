"""Ray integration (optional extra: pip install 'overnight[ray]'), two ways:

1. A processor for ray.data.Dataset.map_batches (one engine per actor; rows in, rows out):

    ds = ray.data.read_json("prompts.jsonl")          # rows with "prompt" (text) or "messages" (chat)
    ds = generate_dataset(ds, model="/models/Qwen3-8B", num_replicas=8,
                          sampling_params={"temperature": 0, "max_tokens": 256})
    ds.write_json("out/")   # each row + generated_text, num_prompt_tokens, num_generated_tokens,
                            # finish_reason, error

   Ray Data streams blocks of rows to the actors; when an actor dies it is restarted and its unfinished
   blocks run again, so every row comes out exactly once. A row that cannot be served gets its message
   in `error` and the others go on.

2. build_ray_engine (overnight/build.py): engines as replicas on a cluster behind one front, for
   `overnight run-batch --ray` (parallel/ray.py). See docs/scaling.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from overnight.build import build_ray_engine
from overnight.entrypoints.llm import LLM
from overnight.errors import InvalidRequestError
from overnight.options import EngineOptions
from overnight.parallel.ray import require_ray
from overnight.sampling_params import SamplingParams

if TYPE_CHECKING:
    import ray.data

OUTPUT_COLUMNS = ("generated_text", "num_prompt_tokens", "num_generated_tokens", "finish_reason", "error")

__all__ = ["EngineActor", "build_ray_engine", "generate_dataset", "require_ray"]


def _plain(value: Any) -> Any:
    """numpy values from a batch -> Python values (token ids must be ints, messages lists of dicts)."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class EngineActor:
    """The callable class map_batches runs in each actor: an LLM built once, a batch of rows per call.

    A row's prompt is its `prompt_column` (a string or token ids) or, failing that, its "messages" (a
    chat, rendered with the model's template); a "sampling_params" column (dicts) overrides the
    defaults per row."""

    def __init__(
        self,
        engine_options: dict[str, Any],
        sampling_params: dict[str, Any] | None = None,
        prompt_column: str = "prompt",
    ) -> None:
        self.llm = LLM(**engine_options)
        self.defaults = dict(sampling_params or {})
        self.prompt_column = prompt_column

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        num_rows = len(next(iter(batch.values()))) if batch else 0
        prompts, params, rows = [], [], []
        errors: list[str | None] = [None] * num_rows
        for i in range(num_rows):
            try:
                text, ids, sp = self._prepare(batch, i)
            except (InvalidRequestError, TypeError, ValueError) as e:
                errors[i] = str(e)
                continue
            prompts.append({"prompt": text, "prompt_token_ids": ids})
            params.append(sp)
            rows.append(i)
        outputs = self.llm.generate(prompts, params, use_tqdm=False) if prompts else []
        text_out: list[str | None] = [None] * num_rows
        num_prompt = [0] * num_rows
        num_generated = [0] * num_rows
        finish: list[str | None] = [None] * num_rows
        for i, out in zip(rows, outputs, strict=True):
            completion = out.outputs[0]
            text_out[i] = completion.text
            num_prompt[i] = len(out.prompt_token_ids)
            num_generated[i] = len(completion.token_ids)
            finish[i] = completion.finish_reason
        result = dict(batch)
        for name, values in zip(
            OUTPUT_COLUMNS, (text_out, num_prompt, num_generated, finish, errors), strict=True
        ):
            result[name] = np.array(
                values, dtype=object if name in ("generated_text", "finish_reason", "error") else np.int64
            )
        return result

    def _prepare(self, batch: dict[str, np.ndarray], i: int) -> tuple[str | None, list[int], SamplingParams]:
        from overnight.entrypoints.prompts import render_conversation, tokenize_prompt

        engine = self.llm.engine
        if self.prompt_column in batch:
            text, ids = tokenize_prompt(_plain(batch[self.prompt_column][i]), engine.tokenizer)
        elif "messages" in batch:
            text, ids = render_conversation(_plain(batch["messages"][i]), engine.tokenizer)
        else:
            raise InvalidRequestError(f'the row has neither a "{self.prompt_column}" nor a "messages" column')
        overrides = _plain(batch["sampling_params"][i]) if "sampling_params" in batch else None
        sp = SamplingParams(**{**self.defaults, **(overrides or {})})
        if sp.n != 1:
            raise InvalidRequestError("n > 1 is not supported here: one row, one completion")
        engine.validate(ids, sp)
        return text, ids, sp


def generate_dataset(
    ds: ray.data.Dataset,
    *,
    model: str | None = None,
    num_replicas: int = 1,
    batch_size: int = 256,
    sampling_params: dict[str, Any] | None = None,
    prompt_column: str = "prompt",
    gpus_per_replica: float | None = None,
    cpus_per_replica: float = 1.0,
    **engine_options: Any,
) -> ray.data.Dataset:
    """ds with the generation columns added (lazily, like any Ray Data transform), run by
    `num_replicas` actors. engine_options are LLM's keyword options (tensor_parallel_size, dtype,
    max_model_len, ...). gpus_per_replica defaults to tensor_parallel_size when the cluster has GPUs,
    else 0. batch_size rows go to an engine at once: keep it at or above max_num_seqs so the engine
    has a full batch to schedule."""
    ray = require_ray()
    options = {"model": model, **engine_options}
    EngineOptions.from_kwargs(**options)  # unknown options fail here, not in every actor
    SamplingParams(**(sampling_params or {})).validate()
    if gpus_per_replica is None:
        has_gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
        gpus_per_replica = float(engine_options.get("tensor_parallel_size", 1)) if has_gpus else 0.0
    return ds.map_batches(
        EngineActor,
        fn_constructor_kwargs={
            "engine_options": options,
            "sampling_params": sampling_params,
            "prompt_column": prompt_column,
        },
        batch_size=batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=num_replicas),
        num_gpus=gpus_per_replica,
        num_cpus=cpus_per_replica,
    )
