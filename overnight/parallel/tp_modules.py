"""The modules tensor parallelism puts in place of a model's own (parallel/tp.py): row-parallel linears
(float and FP8) whose partial products are all-reduced, the vocab-parallel embedding and the LM head
whose logits are all-gathered; reduce_once, for a block whose output sums several row-parallel parts."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from overnight.errors import ModelLoadError
from overnight.parallel.tp_experts import RowParallelExperts, reduce_partial
from overnight.quant.fp8 import QuantizedActivation
from overnight.quant.linear import Fp8Linear


class RowParallelLinear(nn.Module):
    """y = sum over ranks of (x_r @ W_r^T), then + bias: each rank holds the input columns of its share."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.group = group
        self.reduces = True  # False: the partial product alone (reduce_once; no bias then)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return reduce_partial(y, self.bias, self.group) if self.reduces else y


class RowParallelFp8Linear(Fp8Linear):
    """RowParallelLinear for an FP8 layer: this rank's input columns of the weight (and of block
    scales), the partial products all-reduced, then the bias added once."""

    def __init__(
        self,
        layer: Fp8Linear,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        group: dist.ProcessGroup | None,
    ) -> None:
        """weight, weight_scale: this rank's shares of the layer's (TPShards.shard)."""
        super().__init__(
            weight.shape[1], layer.out_features, False, layer.out_dtype, layer.block_k, device=weight.device
        )
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.bias = layer.bias
        self.group = group
        self.reduces = True  # False: the partial product alone (reduce_once; no bias then)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        y = self.matmul(x)
        return reduce_partial(y, self.bias, self.group) if self.reduces else y


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the ids in its vocab rows, zeros for the others; the sum over ranks is the
    embedding (adding zeros is exact, so the result equals the unsharded lookup bit for bit)."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(x, group=self.group)
        return x


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocab rows, all-gathered into [S, vocab_size] on every rank (all ranks
    then sample identically, and the runner code stays the same on each)."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = (
            weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        )
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


ROW_PARALLEL_PARTS = (RowParallelExperts, RowParallelLinear, RowParallelFp8Linear)


def reduce_once(block: nn.Module, parts: tuple[str, ...], group: dist.ProcessGroup | None) -> None:
    """Make a block whose output is the sum of row-parallel `parts` (their names inside it) all-reduce
    once: each part returns its partial sum, and the block's `reduce_output` hook all-reduces the total
    in place (sum over ranks of (a_r + b_r) = sum of a_r + sum of b_r: one collective, not one a part).
    Biases would then be added on every rank, so a part with a bias is refused (the experts' down bias
    is rank 0's alone: it passes)."""
    for name in parts:
        part = block.get_submodule(name)
        if not isinstance(part, ROW_PARALLEL_PARTS):
            raise ModelLoadError(
                f"tensor parallelism cannot sum {name} ({type(part).__name__}) into one all-reduce with the "
                "rest of its block; use tensor_parallel_size 1"
            )
        if getattr(part, "bias", None) is not None:
            raise ModelLoadError(
                f"tensor parallelism cannot sum {name}, which has a bias, into one all-reduce with the rest "
                "of its block; use tensor_parallel_size 1"
            )
        part.reduces = False
    setattr(block, "reduce_output", partial(dist.all_reduce, group=group))  # noqa: B010 (a plain attribute)
