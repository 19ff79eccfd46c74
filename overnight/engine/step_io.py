"""What crosses between the scheduler and the model runner each step (typed, picklable messages).

The runner keeps its own copy of each running request (token ids, block table, sampling settings), so a
step sends only what changed: requests seen for the first time (or again after a preemption) in full,
running ones as the blocks they gained (per KV cache group). Blocks a windowed group gives back are
not announced: the runner's table keeps their ids, and nothing reads positions outside a window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from overnight.lora.request import LoRARequest
from overnight.multimodal.inputs import MultiModalInputs
from overnight.pooling_params import PoolingParams
from overnight.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt + any output generated before a preemption
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    block_ids: list[list[int]]  # per KV cache group (kv_groups.py): its whole table
    num_computed_tokens: int  # prefix-cache hit: tokens whose KV is already in the blocks
    resumed: bool = False  # scheduled again after a preemption
    pooling: PoolingParams | None = None  # a pooling request: its prompt ends in a vector, not a token
    lora_request: LoRARequest | None = None  # its adapter (the slot it is in: SchedulerOutput.lora_loads)
    multi_modal: MultiModalInputs | None = None  # its images: the runner encodes them as chunks reach them
    # Hybrid models with a prefix hit: the state snapshot to copy into its slot first (state_snapshots.py)
    restore_snapshot: int | None = None


@dataclass(slots=True)
class CachedRequestData:
    req_id: str
    new_block_ids: list[list[int]]  # per KV cache group, appended to its table


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    # Tokens to compute this step, per request, in schedule order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests gone since the last step (finished, aborted, preempted): the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # LoRA adapters the runner copies into device slots before this step (lora/residency.py).
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)
    # Hybrid models: (request, snapshot id) whose state to copy into that snapshot after this step
    state_saves: list[tuple[str, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities of the raw model distribution at one generated position."""

    sampled_logprob: float
    sampled_rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class PromptTokenLogprobs:
    """Logprobs of the prompt tokens at positions [start, start + len(logprobs)) computed by one step
    (position 0 has none: nothing predicts it)."""

    start: int
    logprobs: list[float]  # of the actual prompt token
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # requests that produced a token this step
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None  # aligned with req_ids when any asked
    # Host time the step's structured-output mask took (runner/grammar_mask.py): waiting for the step
    # before it, then building the mask. Both are part of the step's launch.
    mask_wait_s: float = 0.0
    mask_s: float = 0.0
    # request id -> its prompt tokens scored this step, for requests with prompt_logprobs
    prompt_logprobs: dict[str, PromptTokenLogprobs] | None = None
    # Pooling requests whose prompt ended this step, and their vectors (float32, on the host).
    pooled_req_ids: list[str] = field(default_factory=list)
    pooled: list[torch.Tensor] = field(default_factory=list)
