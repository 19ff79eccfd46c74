"""overnight: an LLM inference engine for batch and offline jobs."""

from overnight.entrypoints.llm import LLM
from overnight.errors import InvalidRequestError, ModelLoadError, OvernightError
from overnight.outputs import CompletionOutput, Logprob, RequestOutput
from overnight.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "OvernightError",
    "InvalidRequestError",
    "ModelLoadError",
]
