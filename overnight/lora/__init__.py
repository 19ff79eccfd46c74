"""Many LoRA adapters in one batch (vLLM's LoRARequest API, S-LoRA / Punica batching).

    request.py    LoRARequest: which adapter a prompt runs with (name, id, folder)
    adapter.py    a PEFT folder read and checked against the base model (no weights), then loaded
    residency.py  the scheduler's side: which adapters hold the max_loras device slots each step
    layers.py     the runner's side: linear layers wrapped with stacked per-slot A/B buffers
    slots.py      the runner's CPU cache (LRU of max_cpu_loras) and the copies into device slots
    modules.py    --lora-modules name=path for run-batch and serve

The kernels (shrink x @ A^T, expand h @ B^T per row's slot) are in overnight/kernels/lora.py.
"""

from overnight.lora.request import LoRARequest

__all__ = ["LoRARequest"]
