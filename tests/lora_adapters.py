"""Random PEFT LoRA adapters for tiny test models, saved as PEFT saves them (adapter_config.json +
adapter_model.safetensors), and their merged references."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.tiny_models import load_reference


def make_adapter(
    base: str | os.PathLike,
    folder: str | os.PathLike,
    *,
    r: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] | str = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    seed: int = 0,
    load=load_reference,
    **extra,
) -> Path:
    """A LoRA of rank r on `targets` of the model in `base` (as `load` reads it), with random A and B
    (PEFT starts B at zero, which would change nothing) large enough to change greedy outputs. `targets`
    may be a str: PEFT's regex over module paths."""
    from peft import LoraConfig, get_peft_model

    model = load(base)
    modules = targets if isinstance(targets, str) else list(targets)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=modules, lora_dropout=0.0, use_rslora=use_rslora, **extra
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.6 / p.shape[1] ** 0.5 * r / alpha)
    peft_model.save_pretrained(folder)
    return Path(folder)


def merged_reference(base: str | os.PathLike, adapter: str | os.PathLike, load=load_reference):
    """The base model with the adapter merged into its weights (PEFT's merge_and_unload)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load(base), str(adapter))
    return model.merge_and_unload().eval()
