"""Apertus (Swiss AI): Llama's blocks with an RMSNorm over each head of q and k before RoPE and an
ungated MLP, down(xielu(up(x))), whose xIELU activation learns two scalars per layer
(layers/xielu.py). Its checkpoints name the two block norms attention_layernorm and
feedforward_layernorm; rename_checkpoint maps them to Llama's input_layernorm and
post_attention_layernorm (the same places: before attention, before the MLP) and drops the
activation's constant beta / eps buffers after checking they hold the values the model computes with.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.layers.xielu import XIELU, XIELU_BETA, XIELU_EPS
from overnight.models.checkpoint import load_packed_weights
from overnight.models.llama import LlamaForCausalLM

# Only q/k/v fuse: the MLP has no gate to pair up_proj with.
PACKED_MODULES_MAPPING: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
}
_NORM_NAMES = {"attention_layernorm": "input_layernorm", "feedforward_layernorm": "post_attention_layernorm"}
_NORM = re.compile(r"\.(attention_layernorm|feedforward_layernorm)\.")
_CONSTANTS = {"beta": XIELU_BETA, "eps": XIELU_EPS}


class ApertusMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = XIELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


def apertus_mlp(arch: ModelArch, layer_idx: int) -> nn.Module:
    return ApertusMLP(arch.hidden_size, arch.intermediate_size)


class ApertusForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = PACKED_MODULES_MAPPING
    # The norms feed one projection each; xIELU hands over no quantized output.
    linear_input_producers: dict[str, str] = {
        "input_layernorm": "self_attn.qkv_proj",
        "post_attention_layernorm": "mlp.up_proj",
    }

    make_mlp = staticmethod(apertus_mlp)

    @staticmethod
    def rename_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Applied before FP8 conversion and tensor-parallel slicing (loader/model_loader)."""
        for name, tensor in weights:
            leaf = name.rpartition(".")[2]
            if ".act_fn." in name and leaf in _CONSTANTS:
                value = float(tensor.float().reshape(-1)[0])
                expected = _CONSTANTS[leaf]
                if abs(value - expected) > 1e-2 * abs(expected):  # bf16 stores them rounded
                    raise ModelLoadError(
                        f"{name} is {value}, but Apertus' xIELU is implemented for {leaf} = {expected}"
                    )
                continue
            yield _NORM.sub(lambda m: f".{_NORM_NAMES[m.group(1)]}.", name), tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, self.rename_checkpoint(weights))  # idempotent: renamed names pass
