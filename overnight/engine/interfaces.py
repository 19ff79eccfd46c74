"""The engine's two declared surfaces.

    entry points (LLM, run-batch, serve, bench, metrics)
        │  EngineClient: what every engine offers; Engine and the data-parallel front implement it
        ▼
    Engine ──Runner──► the model runner, the tensor-parallel group, or a fake in tests

Callers use these and nothing else of an engine; the type checker holds both sides to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from overnight.config import EngineConfig
from overnight.engine.pool_plan import PoolPlan
from overnight.engine.scheduler import SchedulerStats
from overnight.engine.stats import StatsObserver
from overnight.engine.step_io import ModelRunnerOutput, SchedulerOutput
from overnight.loader.source import ModelSource
from overnight.lora.request import LoRARequest
from overnight.multimodal.inputs import MultiModalInputs
from overnight.outputs import EngineOutput, RequestOutput
from overnight.pooling_params import RequestParams

if TYPE_CHECKING:
    from overnight.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class AddRequest:
    """EngineClient.add_request's arguments as one message: what the server's engine thread and the
    data-parallel front queue, and what the front sends to its engine processes."""

    request_id: str
    prompt_token_ids: list[int]
    params: RequestParams
    prompt: str | None
    stream: bool
    arrival_time: float  # time.monotonic() is one clock for every process of the machine
    lora_request: LoRARequest | None = None
    multi_modal: MultiModalInputs | None = None


class StepHandle(Protocol):
    """A launched step; result() waits for its sampled tokens (once; later calls return the same)."""

    def result(self) -> ModelRunnerOutput: ...


class Runner(Protocol):
    """Runs one step: launch() enqueues it and returns a handle. A runner with supports_async returns
    before the step's tokens are known (the engine then schedules one step ahead); others return a
    handle whose result is ready."""

    @property
    def supports_async(self) -> bool: ...

    def launch(self, out: SchedulerOutput) -> StepHandle: ...

    def shutdown(self) -> None: ...


@dataclass
class StepTimings:
    """Where the host's time goes, summed over steps. With a runner that launches asynchronously,
    wait_s is the time the host sat idle waiting for the GPU: the larger it is, the less the host
    limits throughput."""

    steps: int = 0
    schedule_s: float = 0.0
    launch_s: float = 0.0  # building inputs and enqueueing the step (or running it, on the CPU)
    wait_s: float = 0.0  # blocked on the device for a step's tokens
    update_s: float = 0.0  # scheduler update, outputs, stats
    # Parts of launch_s, for steps with structured outputs: waiting for the previous step's tokens
    # (which the grammar matchers need), then advancing the matchers and filling the token mask.
    mask_wait_s: float = 0.0
    mask_s: float = 0.0

    def summary(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {
            "steps": self.steps,
            "schedule_ms": round(1e3 * self.schedule_s / n, 3),
            "launch_ms": round(1e3 * self.launch_s / n, 3),
            "wait_ms": round(1e3 * self.wait_s / n, 3),
            "update_ms": round(1e3 * self.update_s / n, 3),
            "mask_wait_ms": round(1e3 * self.mask_wait_s / n, 3),
            "mask_ms": round(1e3 * self.mask_s / n, 3),
        }


class EngineClient(Protocol):
    """An engine as the entry points see it: one engine, or several behind a data-parallel front.

    config describes what the group runs at once (a data-parallel front sums max_num_seqs over its
    engines); pool_plan is one engine's KV pool."""

    config: EngineConfig
    source: ModelSource
    tokenizer: Tokenizer | None
    pool_plan: PoolPlan
    observers: list[StatsObserver]
    max_model_len: int
    num_steps: int
    # Host time per step of a local engine; None where the steps run elsewhere (data parallel).
    timings: StepTimings | None

    def validate(self, ids: list[int], params: RequestParams) -> None:
        """Raise InvalidRequestError if this prompt and params cannot be served."""
        ...

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
    ) -> None: ...

    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    def step(self) -> list[EngineOutput]:
        """Outputs of this step: RequestOutputs of generation requests, PoolingRequestOutputs of
        pooling ones (an engine serves the kind config.model.runner names)."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    @property
    def num_unfinished_requests(self) -> int: ...

    def unfinished_request_ids(self) -> list[str]: ...

    def stats(self) -> SchedulerStats: ...

    def shutdown(self) -> None:
        """Stop worker processes; the engine takes no requests afterwards."""
        ...
