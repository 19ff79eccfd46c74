"""PoolingParams: what a pooling (embedding) request asks for, with the names vLLM users know.

A request carries SamplingParams (generate text) or PoolingParams (one vector for the whole prompt);
the engine serves the kind its runner was started for (EngineOptions.runner).
"""

from __future__ import annotations

from dataclasses import dataclass

from overnight.errors import InvalidRequestError
from overnight.sampling_params import SamplingParams


@dataclass(frozen=True)
class PoolingParams:
    # Matryoshka: keep the first `dimensions` values (then normalize, if normalizing). None: the full
    # vector. Only models trained for it accept a smaller size (the engine checks).
    dimensions: int | None = None
    # L2-normalize the vector. None: as the model's pooling config says (its sentence-transformers
    # Normalize module, or the normalize option).
    normalize: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise InvalidRequestError(f"dimensions must be an integer >= 1, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true, false or unset, got {self.normalize!r}")


# What a request carries: which one decides what the engine does with its prompt.
RequestParams = SamplingParams | PoolingParams
