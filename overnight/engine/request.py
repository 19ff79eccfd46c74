"""A request as the scheduler sees it: token counts, status, and why it finished."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from overnight.lora.request import LoRARequest, hash_root
from overnight.multimodal.inputs import MultiModalInputs
from overnight.pooling_params import PoolingParams
from overnight.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self in _FINISHED else None


# The params a pooling request carries where a Request needs SamplingParams: nothing is sampled.
NO_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)

_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated, or one prompt being pooled. A prompt with n > 1 becomes n of these
    (see engine.parent).

    A pooling request (pooling_params set) is a prefill that ends in a vector instead of a token: it
    holds max_total_tokens = prompt + 1, so its "pending token" after the last chunk is that vector,
    and it finishes when the vector arrives (its params are NO_SAMPLING, never read for sampling).

    Invariant: 0 <= num_computed_tokens <= num_tokens + num_pending. The tokens in
    [num_computed_tokens, num_tokens + num_pending) still need a forward pass: the prompt tail before
    the first sample, exactly one (the last sampled token) while decoding, everything again after a
    preemption. num_pending counts tokens a launched step will sample but whose ids have not reached
    the host yet (at most one step runs ahead of the host, so 0, 1 or 2).
    """

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: the user's seed, or one drawn from the engine's RNG
    eos_token_ids: frozenset[int]
    max_total_tokens: int  # prompt + output never exceeds this (max_model_len, max_tokens)
    arrival_time: float
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_cached_tokens: int = -1  # prefix-cache hit on first scheduling; -1 until then
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_cached_blocks: int = 0  # leading full blocks registered in the prefix cache
    # Token ids that may end the request (EOS unless ignore_eos, and stop_token_ids): one set lookup
    # per sampled token on the hot path.
    stop_ids: frozenset[int] = frozenset()
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # None: the base model
    multi_modal: MultiModalInputs | None = None  # its images (vision-language models)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        ids = set(self.params.stop_token_ids or [])
        if not self.params.ignore_eos:
            ids |= self.eos_token_ids
        self.stop_ids = frozenset(ids)

    @property
    def block_hash_root(self) -> int | None:
        """Where the request's chain of block hashes starts: KV computed under one adapter is never
        found by a request of another (or of the base model)."""
        return hash_root(self.lora_request)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_remaining(self) -> int:
        """Tokens that still need a forward pass before the next sample."""
        if len(self.all_token_ids) + self.num_pending >= self.max_total_tokens:
            return 0  # the pending token ends it by length: computing past it would be wasted
        return len(self.all_token_ids) + self.num_pending - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def check_stop(self, token_id: int) -> RequestStatus | None:
        """Token-level stop rules, applied right after token_id was appended."""
        if token_id in self.stop_ids and self.num_output_tokens >= self.params.min_tokens:
            if token_id in (self.params.stop_token_ids or ()):
                self.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if len(self.all_token_ids) >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
