"""overnight: an LLM inference engine for batch and offline jobs."""

from overnight.entrypoints.llm import LLM
from overnight.errors import InvalidRequestError, ModelLoadError, OvernightError
from overnight.lora.request import LoRARequest
from overnight.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from overnight.pooling_params import PoolingParams
from overnight.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LoRARequest",
    "SamplingParams",
    "StructuredOutputsParams",
    "PoolingParams",
    "RequestOutput",
    "PoolingRequestOutput",
    "PoolingOutput",
    "EmbeddingRequestOutput",
    "EmbeddingOutput",
    "ScoringRequestOutput",
    "ScoringOutput",
    "ClassificationRequestOutput",
    "ClassificationOutput",
    "CompletionOutput",
    "Logprob",
    "OvernightError",
    "InvalidRequestError",
    "ModelLoadError",
]
