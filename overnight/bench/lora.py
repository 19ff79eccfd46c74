"""`bench throughput --lora-adapters N`: the workload on the base model alone, then with its requests
spread round-robin over N random LoRA adapters (rank --lora-rank on every projection) in one batch,
in one process; the table gives the ratio (the issue's bar: 8 adapters at >= 0.8x the base model).

The adapters are written as PEFT folders (adapter_config.json + adapter_model.safetensors) of the
model's shapes into a temporary folder, so any model, dummy presets included, can be measured."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace

import torch

from overnight.arch import ModelArch
from overnight.bench.throughput import RunResult, run_ours
from overnight.bench.workloads import Workload
from overnight.lora.adapter import WEIGHTS_FILE
from overnight.lora.request import LoRARequest
from overnight.lora.targets import family_targets, locate, module_dims, num_layers
from overnight.options import EngineOptions


def write_random_adapters(
    arch: ModelArch, n: int, rank: int, folder: str, seed: int = 0
) -> list[LoRARequest]:
    """n adapters of `rank` on every projection of every layer (none on a sparse layer's experts)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    targets = family_targets(arch)
    adapters = []
    for i in range(n):
        path = os.path.join(folder, f"adapter{i}")
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for layer in range(num_layers(arch)):
            for name, proj in targets.items():
                found = locate(arch, name, layer)
                if found is None:
                    continue
                d_in, sizes = module_dims(arch, found[0], layer)
                d_out = sum(sizes[s] for s in found[1])
                prefix = f"base_model.model.model.layers.{layer}.{proj.path(name)}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) / d_in**0.5
                tensors[f"{prefix}.lora_B.weight"] = 0.1 * torch.randn(d_out, rank, generator=gen) / rank**0.5
        save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, os.path.join(path, WEIGHTS_FILE))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(targets)}
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        adapters.append(LoRARequest(f"adapter{i}", i + 1, path))
    return adapters


def run(opts: EngineOptions, workload: Workload, num_adapters: int, rank: int) -> list[RunResult]:
    """[the base model alone, the same workload over num_adapters adapters]."""
    from overnight.build import resolve_model

    base, _ = run_ours(replace(opts, enable_lora=False), workload)
    base.engine = "overnight (base model)"
    arch = resolve_model(replace(opts, skip_tokenizer_init=True)).source.arch
    with tempfile.TemporaryDirectory(prefix="overnight-lora-") as folder:
        adapters = write_random_adapters(arch, num_adapters, rank, folder)
        lora_opts = replace(
            opts, enable_lora=True, max_loras=max(opts.max_loras, num_adapters), max_lora_rank=rank
        )
        n = workload.num_requests
        ours, _ = run_ours(lora_opts, workload, lora_requests=[adapters[i % num_adapters] for i in range(n)])
    ours.engine = f"overnight ({num_adapters} LoRA, rank {rank})"
    return [ours, base]
