"""What the engine returns, with the fields users know: RequestOutput / CompletionOutput for generated
text, PoolingRequestOutput for a pooled vector (EmbeddingRequestOutput is the form LLM.embed() returns)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: its Logprob plus the top-k there; None for the first (nothing predicts it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # LLM.chat with a reasoning parser or tools: `text` is then the answer alone, the reasoning and the
    # calls (overnight.tool_calls.ToolCall: id, name, arguments as JSON text) are here.
    reasoning_content: str | None = None
    tool_calls: list[Any] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # True for a streaming request: each CompletionOutput then holds only the text and token ids it
    # gained since the previous RequestOutput of this request (and logprobs of those tokens).
    delta: bool = False
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs asked


@dataclass(slots=True)
class PoolingOutput:
    data: torch.Tensor  # [dimensions] float32 on the host: the pooled (and normalized) vector


@dataclass(slots=True)
class PoolingRequestOutput:
    """The one output of a pooling request (it is finished when it arrives)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(
            request_id=out.request_id,
            prompt=out.prompt,
            prompt_token_ids=out.prompt_token_ids,
            outputs=EmbeddingOutput(out.outputs.data.tolist()),
            finished=out.finished,
        )


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # one per label: the activation's output (softmax / sigmoid), or the logits

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """What LLM.classify returns per prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        probs = ClassificationOutput(out.outputs.data.tolist())
        return cls(out.request_id, out.prompt, out.prompt_token_ids, probs, out.finished)


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """What LLM.score returns per pair; prompt_token_ids: the pair as the model read it (an embedding
    model's: the two texts' ids, one after the other)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ScoringRequestOutput:
        score = ScoringOutput(float(out.outputs.data[0]))
        return cls(out.request_id, out.prompt, out.prompt_token_ids, score, out.finished)


# What an engine step hands back: generated text, or a pooled vector.
EngineOutput = RequestOutput | PoolingRequestOutput
