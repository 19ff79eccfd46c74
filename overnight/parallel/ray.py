"""Ray: engines on a Ray cluster, two ways.

1. A processor for ray.data.Dataset.map_batches (one engine per actor; rows in, rows out):

    ds = ray.data.read_json("prompts.jsonl")          # rows with "prompt" (text) or "messages" (chat)
    ds = generate_dataset(ds, model="/models/Qwen3-8B", num_replicas=8,
                          sampling_params={"temperature": 0, "max_tokens": 256})
    ds.write_json("out/")   # each row + generated_text, num_prompt_tokens, num_generated_tokens,
                            # finish_reason, error

   Ray Data streams blocks of rows to the actors; when an actor dies it is restarted and its unfinished
   blocks run again, so every row comes out exactly once. A row that cannot be served gets its message
   in `error` and the others go on.

2. build_ray_engine: a DataParallelEngine whose engines are Ray actors (RayLinks), for
   `overnight run-batch --ray`: the driver reads and writes the files and deals requests to the
   replicas by load, so run-batch's order, resume and error handling are unchanged. A replica that is
   lost (killed, its node gone) is replaced, and its unfinished requests are dealt again to the others
   from the start; an output is taken only from the replica its request is dealt to, so none is lost
   or written twice.

Each replica holds one engine on tensor_parallel_size GPUs (Ray sets the actor's CUDA_VISIBLE_DEVICES).
`ray[data]` is an optional extra (pip install 'overnight[ray]'); without it these functions raise
ImportError saying so.
"""

from __future__ import annotations

import queue
import threading
import traceback
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from overnight.engine.builder import EngineOptions
from overnight.errors import EngineDeadError, InvalidRequestError
from overnight.parallel.dp import DataParallelEngine
from overnight.parallel.links import EngineFailed, EngineLost, EngineReady, serve_engine
from overnight.parallel.workers import MULTICAST_OFF, Shutdown
from overnight.sampling_params import SamplingParams

if TYPE_CHECKING:
    import ray.data

RAY_MISSING = (
    "this needs Ray Data, an optional extra: pip install 'overnight[ray]' (or pip install 'ray[data]') "
    "on the driver and on every node of the cluster"
)
# A replica's take() returns after this long with nothing, so the driver's wait stays short.
TAKE_TIMEOUT_S = 5.0
OUTPUT_COLUMNS = ("generated_text", "num_prompt_tokens", "num_generated_tokens", "finish_reason", "error")


def require_ray():
    """The ray module, or ImportError with the install command."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ImportError(RAY_MISSING) from e
    return ray


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
        from overnight.entrypoints.llm import LLM

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


# -- engines as Ray actors --------------------------------------------------------------------------


class EngineServer:
    """The Ray actor holding one engine. A thread of its own runs serve_engine; the driver's messages
    come in through send(), outputs go out through take(). Only that thread touches the engine."""

    def __init__(self, index: int, opts: EngineOptions) -> None:
        from overnight.engine.builder import build_engine

        self.index = index
        self.engine = build_engine(replace(opts, data_parallel_size=1, engine_process=False))
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._outbox: list[object] = []
        self._ready = threading.Condition()
        threading.Thread(target=self._loop, name="overnight-engine", daemon=True).start()

    def ready(self) -> EngineReady:
        return EngineReady(self.index, self.engine.config, self.engine.pool_plan)

    def send(self, msg: object) -> None:
        self._inbox.put(msg)

    def take(self, timeout_s: float) -> list[object]:
        """What the engine has said since the last take, waiting up to timeout_s for something."""
        with self._ready:
            self._ready.wait_for(lambda: self._outbox, timeout_s)
            out, self._outbox = self._outbox, []
        return out

    def _receive(self, block: bool) -> list[object]:
        messages = [self._inbox.get()] if block else []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

    def _say(self, msg: object) -> None:
        with self._ready:
            self._outbox.append(msg)
            self._ready.notify_all()

    def _loop(self) -> None:
        try:
            serve_engine(self.index, self.engine, self._receive, self._say)
        except BaseException:
            self._say(EngineFailed(self.index, traceback.format_exc()))


class RayLinks:
    """EngineLinks over Ray actors: one replica per engine, each with gpus_per_replica GPUs. A replica
    that dies is reported as EngineLost and replaced (up to max_replacements in all); its replacement
    reports EngineReady when its engine is built."""

    def __init__(
        self,
        opts: EngineOptions,
        num_replicas: int,
        *,
        gpus_per_replica: float | None = None,
        cpus_per_replica: float = 1.0,
        max_replacements: int | None = None,
    ) -> None:
        ray = require_ray()
        self._ray = ray
        self.num_engines = num_replicas
        if gpus_per_replica is None:
            has_gpus = ray.cluster_resources().get("GPU", 0) > 0
            gpus_per_replica = float(opts.tensor_parallel_size) if has_gpus else 0.0
        self._actor_cls = ray.remote(EngineServer).options(
            num_gpus=gpus_per_replica,
            num_cpus=cpus_per_replica,
            max_concurrency=4,  # take() may wait while send() calls come in
            max_restarts=0,  # replaced by a fresh actor instead: calls to a dead one never run
            runtime_env={"env_vars": dict(MULTICAST_OFF)},
        )
        self._opts = opts
        self._replacements_left = 2 * num_replicas if max_replacements is None else max_replacements
        self._actors: list = [None] * num_replicas
        self._waiting: dict = {}  # object ref -> (replica index, "ready" | "take")
        for i in range(num_replicas):
            self._start(i)
        self._finalizer = weakref.finalize(self, _kill_actors, ray, self._actors)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def send(self, index: int, msg: object) -> None:
        if not self.alive:
            raise EngineDeadError("the Ray replicas have been shut down")
        self._actors[index].send.remote(msg)  # calls from one caller run in order

    def receive(self) -> list[object]:
        ray = self._ray
        refs = list(self._waiting)
        ray.wait(refs, num_returns=1)  # block until one is ready, then take every one that is
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        messages: list[object] = []
        for ref in done:
            index, kind = self._waiting.pop(ref)
            try:
                got = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                if getattr(e, "actor_init_failed", False):
                    raise EngineDeadError(f"Ray replica {index} could not start its engine:\n{e}") from None
                messages.append(EngineLost(index, str(e)))
                self._replace(index, str(e))
                continue
            if kind == "ready":
                messages.append(got)
            else:
                for msg in got:
                    if isinstance(msg, EngineFailed):
                        raise EngineDeadError(f"Ray replica {index} failed:\n{msg.error}")
                    messages.append(msg)
            self._waiting[self._actors[index].take.remote(TAKE_TIMEOUT_S)] = (index, "take")
        return messages

    def close(self) -> None:
        self._finalizer()

    def _start(self, index: int) -> None:
        actor = self._actor_cls.remote(index, self._opts)
        self._actors[index] = actor
        self._waiting[actor.ready.remote()] = (index, "ready")

    def _replace(self, index: int, reason: str) -> None:
        if self._replacements_left <= 0:
            self.close()
            raise EngineDeadError(f"Ray replica {index} was lost and no replacements are left: {reason}")
        self._replacements_left -= 1
        self._ray.kill(self._actors[index], no_restart=True)
        self._start(index)


def _kill_actors(ray, actors: list) -> None:
    for actor in actors:
        if actor is not None:
            try:
                actor.send.remote(Shutdown())
                ray.kill(actor, no_restart=True)
            except Exception:  # the cluster may be gone already at exit
                pass


def build_ray_engine(
    opts: EngineOptions,
    num_replicas: int,
    *,
    address: str | None = None,
    gpus_per_replica: float | None = None,
    cpus_per_replica: float = 1.0,
) -> DataParallelEngine:
    """An engine-shaped front over `num_replicas` engines on a Ray cluster: the one at `address`
    ("auto": the running cluster, None: RAY_ADDRESS or a new local one), or the one this process is
    already connected to."""
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(address=address)

    def links(o: EngineOptions) -> RayLinks:
        return RayLinks(o, num_replicas, gpus_per_replica=gpus_per_replica, cpus_per_replica=cpus_per_replica)

    return DataParallelEngine(opts, links=links)
