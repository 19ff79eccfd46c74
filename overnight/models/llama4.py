"""Llama 4 (Scout 17B-16E, Maverick 17B-128E) text generation: Llama4ForCausalLM checkpoints and the text
model of Llama4ForConditionalGeneration ones (with images: models/llama4_vl.py, which adds the tower).

Attention, norms and the layer wiring are the dense decoder's (models/llama.py), driven by ModelArch
fields (models/llama4_config.py): RoPE in interleaved pairs with llama3 scaling, and per layer either

    chunked  RoPE, q and k L2-normalized per head after the rotation (use_qk_norm, no weight), a query
             sees only its own chunk of attention_chunk_size positions (LayerAttention.attention_chunk)
    global   no RoPE (NoPE), full attention, q scaled by 1 + attn_scale * ln(1 + floor((p + 1) /
             floor_scale)) (attn_temperature_tuning)

The MLP is dense (intermediate_size_mlp) or, in the MoE layers, Llama4MoE:

    x --> router (plain linear) --> top-k logits --> s = sigmoid(logit)
      \\--> experts(s * x) with routing weight 1, one input per (token, chosen expert) -----+--> out
      \\--> shared_expert(x) (a gated MLP of the experts' width) ---------------------------/

The router's score scales the expert's *input*, not its output (transformers' Llama4TextMoe: the
expert's SiLU-gated MLP is not linear, so the two differ). The experts run through the stacked Experts
(layers/moe.py: the fused Triton MoE on CUDA) with weight 1.

Checkpoints (both layouts, renamed before FP8 conversion and tensor-parallel slicing):

    [language_model.]model.layers.N.feed_forward.*    -> model.layers.N.mlp.*
    language_model.lm_head.weight                      -> lm_head.weight
    ...experts.gate_up_proj [E, H, 2I] (gate | up)     -> [E, 2I, H] (transposed views, layers/moe.py's layout)
    ...experts.down_proj    [E, I, H]                  -> [E, H, I]
    ...experts.E.{gate,up,down}_proj.weight            per expert, as they are (per-expert conversions)
    [model.]vision_model.*, [model.]multi_modal_projector.*
                                                       vision_model.*, multi_modal_projector.* with the
                                                       tower (models/llama4_vl.py), else skipped

A chunked layer's attention reads only the query's chunk, and its KV cache holds only that: chunked
layers form KV cache groups that give back each request's blocks wholly before its first query's chunk
start (engine/kv_groups.py, engine/kv_cache_manager.py), so Scout's 36 chunked layers hold at most 8K
tokens each and only its 12 global layers the whole context.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.layers.moe import Experts
from overnight.models.checkpoint import EXPERT_TENSORS
from overnight.models.llama import (
    LINEAR_INPUT_PRODUCERS,
    PACKED_MODULES_MAPPING,
    LlamaModel,
    dense_mlp,
    load_packed_weights,
    make_lm_head,
)
from overnight.models.qwen3_next import SplitMLP

logger = logging.getLogger(__name__)

_VISION_PREFIXES = (
    "vision_model.",
    "multi_modal_projector.",
    "model.vision_model.",
    "model.multi_modal_projector.",
)
# transformers 5 writes language_model.model.* / language_model.lm_head.*; a model.language_model.* layout
# is read too
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.", ""),
)


class Llama4MoE(nn.Module):
    """Routed experts whose inputs the router's sigmoid scores scale, plus one shared expert."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.router = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.experts = Experts(arch.num_experts, arch.hidden_size, arch.moe_intermediate_size)
        self.shared_expert = SplitMLP(arch.hidden_size, arch.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = x.shape[0], self.top_k
        top, ids = torch.topk(self.router(x), k, dim=-1)
        scores = torch.sigmoid(top.float()).to(x.dtype)  # [T, k], as transformers rounds them
        # One row per (token, chosen expert): the token scaled by that expert's score, routed with
        # weight 1. With top-1 (the published models) that is the token itself, scaled.
        routed = (x[:, None, :] * scores[:, :, None]).reshape(n * k, -1)
        ones = torch.ones(n * k, 1, dtype=torch.float32, device=x.device)
        out = self.experts(routed, ones, ids.reshape(n * k, 1).to(torch.int32))
        if k > 1:
            out = out.view(n, k, -1).sum(dim=1)
        return self.shared_expert(x) + out


def llama4_mlp(arch: ModelArch, layer_idx: int) -> nn.Module:
    return Llama4MoE(arch) if arch.is_moe_layer(layer_idx) else dense_mlp(arch, layer_idx)


class Llama4ForCausalLM(nn.Module):
    """Llama 4's text model (either checkpoint layout: rename_checkpoint)."""

    packed_modules_mapping = PACKED_MODULES_MAPPING
    # Under FP8 the norms before qkv_proj (and the dense layers' gate_up_proj) hand over quantized
    # outputs; a MoE layer's norm feeds the router, the experts and the shared expert.
    linear_input_producers = LINEAR_INPUT_PRODUCERS
    # The router stays in the compute dtype (its top-k decides which expert runs), as in Qwen3-MoE.
    unquantized_linear: tuple[str, ...] = ("mlp.router",)
    dequantized_at_load: tuple[str, ...] = (EXPERT_TENSORS, "mlp.router")
    # Scout's experts are 100B weights (200 GB in bf16): under FP8 they are e4m3 from the build on,
    # each checkpoint tensor quantized per row as it loads (layers/moe.py; quant/apply.py's default).

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}  # filled by load_weights
        self.model = LlamaModel(arch, make_mlp=llama4_mlp)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @staticmethod
    def rename_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Applied to the checkpoint stream before FP8 conversion and tensor-parallel slicing
        (loader/model_loader.checkpoint_weights)."""
        return llama4_names(weights)

    @staticmethod
    def checkpoint_names(module: str) -> tuple[str, ...]:
        """The names a module may carry in a checkpoint and its quantization_config's ignore list
        (Maverick-FP8's modules_to_not_convert names language_model.model.layers.N.feed_forward.*)."""
        if module == "lm_head":
            return module, "language_model.lm_head"
        if not module.startswith("model."):
            return (module,)
        ff = module.replace(".mlp.", ".feed_forward.")
        ff = ff.removesuffix(".mlp") + ".feed_forward" if ff.endswith(".mlp") else ff
        names = [n for own in (module, ff) for n in (own, "language_model." + own)]
        names += ["model.language_model." + own.removeprefix("model.") for own in (module, ff)]
        return tuple(dict.fromkeys(names))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, weights)


def llama4_names(
    weights: Iterable[tuple[str, torch.Tensor]], keep_tower: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Either layout's tensors under the names and layouts of the model above (module docstring); the
    vision tower's and projector's kept (keep_tower) or skipped."""
    skipped = 0
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            if keep_tower:
                yield name.removeprefix("model."), tensor
            else:
                skipped += 1
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        name = name.replace(".feed_forward.", ".mlp.")
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and tensor.dim() == 3:
            tensor = tensor.transpose(1, 2)  # [E, in, out] -> [E, out, in]
        yield name, tensor
    if skipped:
        logger.info("skipped %d vision tensors of the checkpoint: its text model runs", skipped)
