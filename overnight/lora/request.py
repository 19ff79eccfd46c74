"""Which adapter a request runs with: vLLM's LoRARequest."""

from __future__ import annotations

from dataclasses import dataclass

from overnight.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter in the PEFT format (adapter_config.json + adapter_model.safetensors).

    lora_int_id identifies the adapter everywhere inside the engine (device slots, the CPU cache, the
    prefix cache's hash chain): two requests with the same id must name the same folder. It is at
    least 1; no adapter (the base model) has none."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None  # accepted as vLLM spells it; the weights' shapes are checked

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(
                f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer >= 1, got {self.lora_int_id!r}"
            )
        if not self.lora_path:
            raise InvalidRequestError(f"LoRARequest {self.lora_name!r}: lora_path is empty")

    # vLLM's other spellings
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


LORA_ROOT = 0x6C6F_7261  # tags an adapter's root apart from the base model's chain (block_pool.NO_ROOT)


def hash_root(lora: LoRARequest | None) -> int | None:
    """Where a prompt's chain of KV block hashes starts: None for the base model, else its adapter's
    own root, so no two adapters (nor an adapter and the base model) ever share a cached block."""
    # Ints only (a str's hash changes with PYTHONHASHSEED): the chain, and the submission order sorted by
    # it, are the same in every run.
    return None if lora is None else hash((LORA_ROOT, lora.lora_int_id))
