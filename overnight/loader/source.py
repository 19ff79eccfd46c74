"""Where a model comes from, resolved once at start-up: a HF folder, a repo in the local HF cache, a GGUF
file, or a dummy preset. resolve_source() fills this in; loaders and the tokenizer read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from overnight.arch import ModelArch
from overnight.config import LMHeadClassifier
from overnight.quant.int_scheme import IntScheme
from overnight.quant.scheme import QuantScheme


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" | "gguf" | "dummy"
    path: str  # folder, .gguf file, or preset name
    arch: ModelArch
    hf_architecture: str  # e.g. "Qwen3ForCausalLM"
    tokenizer_path: str | None  # folder holding tokenizer files, the .gguf file, or None
    eos_token_ids: tuple[int, ...]  # generation_config.json / config.json / GGUF metadata
    bos_token_id: int | None
    config_dtype: str | None  # torch_dtype / dtype stated by the checkpoint, for dtype="auto"
    served_name: str  # the name outputs report as `model`
    # FP8 linear layers: the checkpoint's quantization_config, or quantization="fp8" (quant/scheme.py);
    # integer weights: the checkpoint's AWQ / GPTQ / compressed-tensors int config (quant/int_scheme.py)
    quantization: QuantScheme | IntScheme | None = None
    # A sequence classifier whose head is made from the LM head's rows of some tokens (Qwen3-Reranker,
    # loader/hf_overrides.py); its token ids are filled in once the tokenizer is loaded (build.py).
    lm_head_classifier: LMHeadClassifier | None = None
    # The hf_overrides option (merged over config.json; read again where config.json is, for labels).
    hf_overrides: dict[str, Any] | None = field(default=None, compare=False)
