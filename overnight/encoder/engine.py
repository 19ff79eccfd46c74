"""EncoderEngine: an encoder-only model (BERT, XLM-R, ModernBERT, NomicBERT, EmbeddingGemma) behind
EngineClient, so LLM.embed, run-batch and the server drive it as they drive the decoder engine.

An encoder has no KV cache and sees each prompt whole (attention is bidirectional), so there is nothing
to schedule token by token: each step takes a batch of waiting prompts of similar lengths (batching.py)
under the token budget (max_num_batched_tokens, counted padded) and max_num_seqs, runs it, and returns one
PoolingRequestOutput per prompt (an embedding, or a classifier's scores). Only pooling requests are
served.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from overnight.config import EngineConfig
from overnight.encoder.batching import EncoderRequest, LengthQueue
from overnight.encoder.runner import EncoderRunner
from overnight.engine.interfaces import StepTimings
from overnight.engine.pool_plan import PoolPlan
from overnight.engine.scheduler import SchedulerStats
from overnight.engine.stats import FinishedRequestStats, IterationStats, StatsObserver
from overnight.engine.validation import limits_of, validate_request
from overnight.errors import InvalidRequestError
from overnight.loader.source import ModelSource
from overnight.lora.request import LoRARequest
from overnight.multimodal.inputs import IMAGES_UNSUPPORTED_HERE, MultiModalInputs
from overnight.outputs import EngineOutput, PoolingOutput, PoolingRequestOutput, RequestMetrics, RequestOutput
from overnight.pooling_params import PoolingParams, RequestParams

if TYPE_CHECKING:
    from overnight.tokenizer.tokenizer import Tokenizer


class EncoderEngine:
    """Implements EngineClient (engine/interfaces.py) for encoder-only models."""

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        tokenizer: Tokenizer | None = None,
        runner: EncoderRunner | None = None,
    ) -> None:
        self.config = config
        self.source = source
        self.tokenizer = tokenizer
        self.pool_plan = PoolPlan(num_blocks=0, block_bytes=0, budget_bytes=0, capped=False)  # no KV cache
        self.observers: list[StatsObserver] = []
        self.max_model_len = config.scheduler.max_model_len
        self.num_steps = 0
        self.timings: StepTimings | None = StepTimings()
        sep = tokenizer.sep_token_id if tokenizer is not None else None
        self.runner = runner or EncoderRunner(config, source, sep_token_id=sep)
        self.waiting = LengthQueue()
        self._limits = limits_of(config, source.arch.vocab_size, tokenizer is not None)

    def validate(self, ids: list[int], params: RequestParams) -> None:
        validate_request(ids, params, self._limits)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: RequestParams | None = None,
        *,
        prompt: str | None = None,
        stream: bool = False,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> None:
        if multi_modal is not None:
            raise InvalidRequestError(IMAGES_UNSUPPORTED_HERE)
        if lora_request is not None:
            raise InvalidRequestError("LoRA adapters are not supported on encoder models")
        params = params if params is not None else PoolingParams()
        if request_id in self.waiting:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        assert isinstance(params, PoolingParams)  # validate() refuses generation requests
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self.waiting.add(EncoderRequest(request_id, prompt, list(prompt_token_ids), params, arrival))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a waiting prompt (a running batch finishes within its step: nothing is ever running
        between steps)."""
        self.waiting.remove(request_id)
        return None

    def step(self) -> list[EngineOutput]:
        t = self.timings or StepTimings()
        t0 = time.perf_counter()
        sched = self.config.scheduler
        batch = self.waiting.take(sched.max_num_batched_tokens, sched.max_num_seqs)
        if not batch:
            return []
        now = time.monotonic()
        t1 = time.perf_counter()
        vectors = self.runner.run(batch)
        t2 = time.perf_counter()
        done = time.monotonic()
        outputs: list[EngineOutput] = []
        for req, vector in zip(batch, vectors):
            metrics = RequestMetrics(req.arrival_time, now, done, done, done)
            outputs.append(
                PoolingRequestOutput(
                    req.request_id, req.prompt, req.token_ids, PoolingOutput(vector), True, metrics
                )
            )
        self.num_steps += 1
        if self.observers:
            self._observe(batch, now, done)
        t.steps += 1
        t.schedule_s += t1 - t0
        t.launch_s += t2 - t1
        t.update_s += time.perf_counter() - t2
        return outputs

    def has_unfinished_requests(self) -> bool:
        return len(self.waiting) > 0

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting)

    def unfinished_request_ids(self) -> list[str]:
        return self.waiting.ids()

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=0,
            num_waiting=len(self.waiting),
            kv_cache_usage=0.0,
            num_preemptions_total=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
        )

    def shutdown(self) -> None:
        """Nothing to stop: the model lives in this process."""

    def _observe(self, batch: list[EncoderRequest], start: float, done: float) -> None:
        tokens = sum(r.num_tokens for r in batch)
        it = IterationStats(num_scheduled_tokens=tokens, num_prompt_tokens=tokens)
        for req in batch:
            it.time_to_first_token.append(done - req.arrival_time)
            it.finished.append(
                FinishedRequestStats(
                    "stop", req.num_tokens, 0, done - req.arrival_time, start - req.arrival_time
                )
            )
        stats = self.stats()
        for obs in self.observers:
            obs.on_step(stats, it)
