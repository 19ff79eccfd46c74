"""vLLM's dummy weights drawn as ours are (overnight/loader/dummy.py): the control of
bench/routing_spread_gpu.py, which asks whether the two engines' dummy models route a MoE's decode
tokens as widely (an expert GEMM reads the weights of the experts its tokens picked, so a narrower
spread would flatter one engine's decode step).

vLLM 0.26 seeds every tensor's draw with one seed (1234), so tensors of one shape hold the same values,
and draws its norm weights uniform(-1e-3, 1e-3); ours draws each tensor from one running generator and
sets norm weights to 1. Measured on an H200 (session R, Qwen3-30B-A3B FP8, 64 requests, greedy): vLLM's
own draw hits 123 of 128 experts a decode step, drawn as ours 123-126, ours 123-127. The draws route
alike, so the pairs keep vLLM's own.

`install()` puts this module where vLLM's processes find it as a general plugin (an entry point in a
temporary dist-info put on PYTHONPATH, so its engine-core process loads it too); the plugin replaces
the two functions vLLM's DummyModelLoader calls:
- norm modules (class names ending in RMSNorm or LayerNorm): weight 1, bias 0, as ours;
- every other floating tensor: uniform(-1e-3, 1e-3) from its own seed (a counter), not a shared one.
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile

import torch

DUMMY_RANGE = 1e-3  # vLLM's and ours
NORM_SUFFIXES = ("RMSNorm", "LayerNorm")
SCHEMES = ("vllm", "overnight")  # vLLM's own draw, or ours

_seeds = itertools.count(1)


def draw_tensor(
    param: torch.Tensor, low: float = -DUMMY_RANGE, high: float = DUMMY_RANGE, seed: int = 0
) -> None:
    """One tensor uniform(low, high) from the next seed of a counter (vLLM passes its shared `seed`,
    ignored here); meta and integer tensors are left as vLLM leaves them."""
    del seed
    if param.device.type == "meta" or not torch.is_floating_point(param):
        return
    gen = torch.Generator(device=param.device).manual_seed(next(_seeds))
    with torch.no_grad():
        if torch.finfo(param.dtype).bits < 16:  # e4m3: uniform_ takes no 8-bit type
            tmp = torch.empty(param.shape, dtype=torch.float16, device=param.device)
            param.data.copy_(tmp.uniform_(low, high, generator=gen).to(param.dtype))
        else:
            param.data.uniform_(low, high, generator=gen)


def draw_module(module: torch.nn.Module, model_config: object = None, **kwargs: float) -> None:
    """vLLM's initialize_dummy_weights(module, model_config) drawn as ours: a norm's weight 1 and bias
    0, every other tensor of the module (its children's too) its own draw."""
    del model_config
    if type(module).__name__.endswith(NORM_SUFFIXES):
        with torch.no_grad():
            for name, tensor in module.named_parameters(recurse=False):
                if tensor.device.type != "meta":
                    tensor.fill_(1.0 if name == "weight" else 0.0)
        return
    low, high = kwargs.get("low", -DUMMY_RANGE), kwargs.get("high", DUMMY_RANGE)
    for tensor in module.state_dict().values():
        draw_tensor(tensor, low, high)


def register() -> None:
    """vLLM's general-plugin hook (every vLLM process calls it once): patch the dummy loader's names."""
    from vllm.model_executor.model_loader import dummy_loader  # type: ignore[import-not-found]

    dummy_loader.initialize_dummy_weights = draw_module
    dummy_loader.initialize_single_dummy_weight = draw_tensor


def install() -> str:
    """Make vLLM load `register` as a general plugin in this process and in those it starts: a dist-info
    with the entry point in a new folder, put first on sys.path and PYTHONPATH. Returns the folder."""
    folder = tempfile.mkdtemp(prefix="ov-vllm-dummy-")
    info = os.path.join(folder, "overnight_vllm_dummy-0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: overnight-vllm-dummy\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\novernight_dummy = bench.vllm_dummy:register\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # `bench` importable there too
    sys.path[:0] = [folder, root]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, root, os.environ.get("PYTHONPATH")) if p)
    return folder
