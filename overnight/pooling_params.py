"""PoolingParams: what a pooling request (an embedding, a class, a pair's score) asks for, with the names
vLLM users know.

A request carries SamplingParams (generate text) or PoolingParams (one vector for the whole prompt);
the engine serves the kind its runner was started for (EngineOptions.runner).
"""

from __future__ import annotations

from dataclasses import dataclass

from overnight.errors import InvalidRequestError
from overnight.sampling_params import SamplingParams

# What a pooling request computes. "embed": a vector (embedding models); "classify": a prompt's class
# probabilities and "score": a pair's relevance (sequence classifiers and cross-encoders; a score prompt
# is the pair as the tokenizer joins it, and BERT's token types follow its first [SEP]).
POOLING_TASKS = ("embed", "classify", "score")


@dataclass(frozen=True)
class PoolingParams:
    # Matryoshka: keep the first `dimensions` values (then normalize, if normalizing). None: the full
    # vector. Only models trained for it accept a smaller size (the engine checks).
    dimensions: int | None = None
    # L2-normalize the vector. None: as the model's pooling config says (its sentence-transformers
    # Normalize module, or the normalize option).
    normalize: bool | None = None
    # None: whatever the model pools (LLM.encode); the entry points set it, and the engine refuses a
    # task the model cannot do (an embedding asked of a classifier, a score of an embedding model).
    task: str | None = None
    # Classifiers: apply the model's activation (sigmoid / softmax, see ClassifierConfig) to the logits.
    # False: the raw logits. None: apply.
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise InvalidRequestError(f"dimensions must be an integer >= 1, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true, false or unset, got {self.normalize!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise InvalidRequestError(
                f"use_activation must be true, false or unset, got {self.use_activation!r}"
            )


# What a request carries: which one decides what the engine does with its prompt.
RequestParams = SamplingParams | PoolingParams
