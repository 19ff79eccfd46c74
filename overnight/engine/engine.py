"""The engine: requests in, RequestOutputs out, one step at a time (schedule -> execute -> update).

Every entry point (LLM, run-batch, serve, bench) is a thin adapter over this class. An engine whose
runner pools (config.model.runner == "pooling") takes PoolingParams requests instead: the same
schedule (prefill only, chunked, prefix-cached), ending in a PoolingRequestOutput per prompt.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from overnight.config import EngineConfig
from overnight.engine.interfaces import Runner, StepHandle, StepTimings
from overnight.engine.kv_cache_manager import KVCacheManager
from overnight.engine.kv_groups import KVCacheLayout
from overnight.engine.output_processor import OutputProcessor, ParentRequest
from overnight.engine.pool_plan import PoolPlan, state_snapshots
from overnight.engine.request import NO_SAMPLING, Request
from overnight.engine.scheduler import Scheduler, SchedulerStats
from overnight.engine.state_snapshots import StateSnapshots
from overnight.engine.stats import FinishedRequestStats, IterationStats, StatsObserver
from overnight.engine.step_io import SchedulerOutput
from overnight.engine.validation import limits_of, validate_images, validate_request
from overnight.errors import ConfigError, InvalidRequestError
from overnight.loader.source import ModelSource
from overnight.lora.adapter import AdapterChecks
from overnight.lora.request import LoRARequest
from overnight.lora.residency import LoRAResidency
from overnight.multimodal.inputs import MultiModalInputs
from overnight.outputs import (
    EngineOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from overnight.pooling_params import PoolingParams, RequestParams
from overnight.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from overnight.structured.compiler import GrammarCompiler
    from overnight.tokenizer.tokenizer import Tokenizer


class Engine:
    """One engine on one runner; implements EngineClient (interfaces.py).

    source: where the model came from (served name, stop ids, vocabulary); pool_plan: the KV pool the
    runner allocated."""

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        source: ModelSource,
        pool_plan: PoolPlan,
        tokenizer: Tokenizer | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.config = config
        self.source = source
        self.pool_plan = pool_plan
        self.runner = runner
        self.tokenizer = tokenizer
        self.grammars = grammars  # compiles structured outputs at validation; None: refused
        self.eos_token_ids = frozenset(source.eos_token_ids)
        self.is_pooling = config.model.runner == "pooling"
        self.vocab_size = source.arch.vocab_size
        self.max_model_len = config.scheduler.max_model_len
        num_blocks = pool_plan.num_blocks
        bs = config.cache.block_size
        layout = KVCacheLayout.from_arch(source.arch, self.max_model_len)
        if pool_plan.block_scales:  # the runner's (one rank's) block sizes: tables must match its pages
            layout = replace(layout, block_scales=pool_plan.block_scales)
        self.kv = KVCacheManager(
            num_blocks,
            bs,
            config.cache.enable_prefix_caching,
            layout.windows,
            layout.block_scales,
            layout.chunks,
        )
        # One sequence of max_model_len must fit, or it could never finish (windowed and chunked groups
        # hold only their window or attention chunk and the chunk being computed).
        chunk = config.scheduler.max_num_batched_tokens
        need = layout.blocks_per_sequence(self.max_model_len, chunk, bs)
        if num_blocks < need:
            # With block scales (kv_groups.py) a block of some groups holds more than block_size tokens.
            sizes = sorted(set(self.kv.group_block_sizes))
            of = f"{bs}" if len(sizes) == 1 else f"{' or '.join(map(str, sizes))} tokens by group"
            raise ConfigError(
                f"the KV pool holds {num_blocks * bs} tokens, less than one sequence of max_model_len "
                f"{self.max_model_len} needs ({need} blocks of {of}): lower max_model_len or give the pool "
                "more memory"
            )
        lora = config.lora
        # LoRA: adapters checked once each (AdapterChecks), device slots handed out by the scheduler.
        self.adapters = AdapterChecks(source.arch, lora.max_lora_rank) if lora else None
        # A waiting adapter lets the slot it reserved take up to one batch more before it drains.
        residency = LoRAResidency(lora.max_loras, grace=config.scheduler.max_num_seqs) if lora else None
        snapshots = None
        if source.arch.num_linear_layers and config.cache.enable_prefix_caching:
            # Hybrid models: a hit needs the linear layers' state at its end (state_snapshots.py).
            snapshots = StateSnapshots(state_snapshots(config.scheduler, config.cache), self.kv)
        self.scheduler = Scheduler(config.scheduler, self.kv, lora=residency, snapshots=snapshots)
        self.output = OutputProcessor(tokenizer)
        self.parents: dict[str, ParentRequest] = {}
        self.children: dict[str, list[Request]] = {}
        self.observers: list[StatsObserver] = []
        self._rng = random.Random(config.model.seed)
        self._last_token_time: dict[str, float] = {}
        self.num_steps = 0
        # One step may run ahead of the host when the runner can launch without waiting.
        self._async = runner.supports_async
        self._inflight: tuple[SchedulerOutput, StepHandle] | None = None
        self.timings: StepTimings | None = StepTimings()

    # -- requests ---------------------------------------------------------------------------------

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
        """Queue one prompt (n completions, or one pooled vector), with a LoRA adapter or on the base
        model. Raises InvalidRequestError and changes nothing if the request cannot be served."""
        if params is None:
            params = PoolingParams() if self.is_pooling else SamplingParams()
        if request_id in self.parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        if lora_request is not None:
            self.check_lora(lora_request)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise InvalidRequestError("LoRA adapters serve generation requests only, not pooling")
            self._add_pooling(request_id, prompt_token_ids, params, prompt, arrival)
            return
        if stream and params.num_samples > params.n:
            raise InvalidRequestError("best_of above n cannot stream: the best are known only at the end")
        if multi_modal is not None:
            budget = self.config.scheduler.max_num_batched_tokens
            text_only = self.config.model.arch.text_only
            validate_images(prompt_token_ids, params, multi_modal, self.max_model_len, budget, text_only)
        truncated = params.truncate_prompt(prompt_token_ids, self.max_model_len)
        prompt_token_ids = truncated
        if self.tokenizer is not None:
            params = params.with_bad_words_tokenized(self.tokenizer)
        parent = ParentRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            n=params.num_samples,
            stream=stream,
            metrics=RequestMetrics(arrival_time=arrival),
            num_returned=params.n,
        )
        max_total = self.max_model_len
        if params.max_tokens is not None:
            max_total = min(max_total, len(prompt_token_ids) + params.max_tokens)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self.parents[request_id] = parent
        kids = []
        for i in range(params.num_samples):
            rid = request_id if params.num_samples == 1 else f"{request_id}#{i}"
            req = Request(
                req_id=rid,
                prompt_token_ids=list(prompt_token_ids),
                params=params,
                seed=(base_seed + i * 0x9E3779B1) % (1 << 63),
                eos_token_ids=self.eos_token_ids,
                max_total_tokens=max_total,
                arrival_time=arrival,
                lora_request=lora_request,
                multi_modal=multi_modal,
            )
            self.output.add(req, parent, i)
            self.scheduler.add(req)
            kids.append(req)
        self.children[request_id] = kids

    def _add_pooling(
        self, request_id: str, ids: list[int], params: PoolingParams, prompt: str | None, arrival: float
    ) -> None:
        self.parents[request_id] = ParentRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(ids),
            n=1,
            stream=False,  # one output, the vector
            metrics=RequestMetrics(arrival_time=arrival),
        )
        req = Request(
            req_id=request_id,
            prompt_token_ids=list(ids),
            params=NO_SAMPLING,
            seed=0,
            eos_token_ids=frozenset(),
            max_total_tokens=len(ids) + 1,  # the "+ 1" is the vector (request.py)
            arrival_time=arrival,
            pooling_params=params,
        )
        self.scheduler.add(req)
        self.children[request_id] = [req]

    def validate(self, ids: list[int], params: RequestParams) -> None:
        """Raise InvalidRequestError if this prompt and params cannot be served."""
        limits = limits_of(self.config, self.vocab_size, self.tokenizer is not None)
        validate_request(ids, params, limits, self.grammars)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Raise InvalidRequestError unless LoRA is enabled and this adapter fits the base model."""
        if self.adapters is None:
            raise InvalidRequestError(
                f"LoRA adapter {lora_request.lora_name!r} asked for, but LoRA is not enabled: start the "
                "engine with enable_lora=True (--enable-lora)"
            )
        self.adapters.check(lora_request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV blocks; returns its final output if it was still running."""
        kids = self.children.pop(request_id, None)
        if kids is None:
            return None
        self.scheduler.abort([r.req_id for r in kids])
        final = None
        for req in kids:
            if req.status.finish_reason == "abort":
                final = self.output.abort(req) or final
            self._last_token_time.pop(req.req_id, None)
        for req in kids:
            self.output.drop(req.req_id)
        self.parents.pop(request_id, None)
        return final

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.parents)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.parents)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        self.runner.shutdown()

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Schedule and launch the next step, then fold in the results of the step before it.

        With a runner that launches asynchronously (CUDA), step N+1 is launched before step N's
        tokens are read, so the host work of one step overlaps the GPU work of the other."""
        t = self.timings or StepTimings()
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        t1 = time.perf_counter()
        handle = None
        if not sched_out.is_empty or sched_out.finished_req_ids:
            handle = self.runner.launch(sched_out)
        t2 = time.perf_counter()
        t.schedule_s += t1 - t0
        t.launch_s += t2 - t1
        outputs: list[EngineOutput] = []
        if self._inflight is not None:
            outputs = self._complete(*self._inflight)
            self._inflight = None
        if handle is not None:
            if self._async:
                self._inflight = (sched_out, handle)
            else:
                outputs += self._complete(sched_out, handle)
        t.steps += 1
        return outputs

    def _complete(self, sched_out: SchedulerOutput, handle: StepHandle) -> list[EngineOutput]:
        t0 = time.perf_counter()
        runner_out = handle.result()
        t1 = time.perf_counter()
        advanced, finished = self.scheduler.update(sched_out, runner_out)
        if runner_out.prompt_logprobs:
            self.output.add_prompt_logprobs(runner_out.prompt_logprobs)
        logprobs = {}
        if runner_out.logprobs is not None:
            logprobs = {rid: lp for rid, lp in zip(runner_out.req_ids, runner_out.logprobs) if lp is not None}
        texts, stopped = self.output.process(advanced, logprobs, finished)
        for req, stop_str in stopped:
            self.scheduler.finish_stopped(req, stop_str)
        outputs: list[EngineOutput] = list(texts)
        if runner_out.pooled_req_ids:
            outputs += self._pooled(runner_out.pooled_req_ids, runner_out.pooled, finished)
        self.num_steps += 1
        if self.observers:
            self._observe(sched_out, advanced, finished + [r for r, _ in stopped])
        self._retire([o for o in outputs if o.finished])
        if self.timings is not None:
            self.timings.wait_s += t1 - t0
            self.timings.mask_wait_s += runner_out.mask_wait_s
            self.timings.mask_s += runner_out.mask_s
            self.timings.update_s += time.perf_counter() - t1
        return outputs

    def _pooled(
        self, req_ids: list[str], vectors: list[torch.Tensor], finished: list[Request]
    ) -> list[PoolingRequestOutput]:
        """The outputs of pooling requests the scheduler just ended (not those aborted meanwhile)."""
        ended = {r.req_id: r for r in finished if r.pooling_params is not None}
        now = time.monotonic()
        outputs = []
        for rid, vector in zip(req_ids, vectors):
            req, parent = ended.get(rid), self.parents.get(rid)
            if req is None or parent is None:
                continue
            m = parent.metrics
            m.first_scheduled_time = req.first_scheduled_time
            m.first_token_time = m.last_token_time = m.finished_time = now
            outputs.append(
                PoolingRequestOutput(
                    request_id=rid,
                    prompt=parent.prompt,
                    prompt_token_ids=parent.prompt_token_ids,
                    outputs=PoolingOutput(vector),
                    metrics=m,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                )
            )
        return outputs

    def _retire(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            self.parents.pop(out.request_id, None)
            for req in self.children.pop(out.request_id, []):
                self._last_token_time.pop(req.req_id, None)

    def _observe(self, sched_out: SchedulerOutput, advanced: list[Request], finished: list[Request]) -> None:
        now = time.monotonic()
        it = IterationStats(num_scheduled_tokens=sched_out.total_num_scheduled_tokens)
        it.num_prompt_tokens = sum(r.num_prompt_tokens for r in sched_out.new_reqs if not r.resumed)
        it.num_generation_tokens = len(advanced)
        for req in advanced:
            last = self._last_token_time.get(req.req_id)
            if last is None:
                it.time_to_first_token.append(now - req.arrival_time)
            else:
                it.inter_token_latency.append(now - last)
            self._last_token_time[req.req_id] = now
        for req in finished:
            it.finished.append(
                FinishedRequestStats(
                    finish_reason=req.status.finish_reason or "stop",
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_generation_tokens=req.num_output_tokens,
                    e2e_latency=now - req.arrival_time,
                    queue_time=(req.first_scheduled_time or now) - req.arrival_time,
                )
            )
        stats = self.scheduler.stats()
        for obs in self.observers:
            obs.on_step(stats, it)
