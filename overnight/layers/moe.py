"""The experts of a sparse (mixture-of-experts) MLP and the router's top-k choice.

Every expert is a gated MLP like the dense one; their weights are stacked, one tensor per projection,
in the layout transformers keeps in memory (the checkpoint's per-expert tensors are copied in by the
loader):

    gate_up_proj  [E, 2I, H]   rows of expert e: [gate | up]
    down_proj     [E, H, I]

Ungated experts (Nemotron-H's: up -> relu^2 -> down, activation "relu2") keep the same two names, with
gate_up_proj [E, I, H] holding the up rows alone: FP8 row scales, dummy weights, tensor-parallel shards
and the fused kernels then treat every stack alike.

A token t goes through the experts topk_ids[t, :] and its output is sum_j topk_weights[t, j] *
expert_j(x_t). Path choice as for the small ops (norm.py's use_kernels): the fused Triton path
(overnight/kernels/fused_moe.py) on CUDA; on the CPU the PyTorch code here, which is also the kernels'
reference.

With FP8 weights (quantization="fp8", FP8 checkpoints) the stacked projections are quantized once they
are loaded (quantize_fp8_): e4m3 values with one float32 scale per expert and row, per channel like
the dense FP8 layers. On a GPU (every CUDA GPU that takes FP8 has FP8 tensor cores: quant/scheme.py)
they run W8A8 like the dense FP8 layers: each GEMM's input rows are quantized per row and the GEMMs
multiply e4m3 by e4m3 (fused_experts' fp8_activations; converting every weight tile to bf16 instead ran
FP8 experts slower than bf16 ones: docs/performance.md, session L). On the CPU they stay weight-only:
the PyTorch path dequantizes the experts it runs, as HF's reference does. Which one is decided by the
weights' device (runs_w8a8 below), so both paths of one device compute the same thing, and
fused_experts_ref(fp8_activations=True) is the GPU arithmetic's reference.
A model whose experts alone outgrow the device in the compute dtype (GLM-4.5-Air's 100B of experts on
one H200; every MoE family now declares it) holds them as e4m3 from the start instead (store_fp8_, at
build time): the loader quantizes each checkpoint expert tensor, per expert or a whole stack, per row as
it arrives (load_fp8_rows_; models/checkpoint.copy_weight). Rows are quantized one by one either way,
so both give the same bytes and scales. gpt-oss's MXFP4 experts held as e4m3 (its fp8 form) take
power-of-two row scales (pow2_scales), which keep their e2m1 values exact.

The PyTorch path loops over the experts that were hit (a host sync per layer), so it cannot be
captured in a CUDA graph; the fused path can.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from overnight.kernels.dispatch import use_kernels


def router_topk_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32), heaviest first.

    Softmax over all experts in fp32, the k largest kept, and with `renormalize` rescaled to sum to 1
    (Qwen3-MoE's norm_topk_prob), as the HF router computes them."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def router_softmax_biased_topk(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, norm_min: float = 1e-12
) -> tuple[torch.Tensor, torch.Tensor]:
    """ERNIE 4.5's choice: logits [T, E] -> (weights [T, k] float32, ids [T, k] int32). Softmax over all
    experts in fp32; the k largest of probabilities + bias [E] (the correction bias chooses, nothing
    more) are taken, weighed by their unbiased probabilities rescaled to sum to 1 (the sum at least
    norm_min). Plain tensor ops, no host sync: it runs as it is inside a captured CUDA graph."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ids = torch.topk(probs + bias.float(), top_k, dim=-1).indices
    weights = probs.gather(-1, ids)
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=norm_min)
    return weights, ids.to(torch.int32)


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert combines its gate and up rows.

    silu:        silu(gate) * up                                   (Qwen3-MoE, Mixtral)
    swiglu_oai:  g = min(gate, limit); u = clamp(up, -limit, limit);
                 g * sigmoid(alpha * g) * (u + 1)                   (gpt-oss, its reference's SwiGLU)
    gelu_tanh:   gelu(gate, tanh approximation) * up                (Gemma 4's experts)
    relu2:       relu(up)^2, no gate                                (Nemotron-H's experts)
    """

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in ("silu", "swiglu_oai", "gelu_tanh", "relu2"):
            raise ValueError(f"unknown expert activation {self.kind!r} (silu, swiglu_oai, gelu_tanh, relu2)")

    @property
    def gated(self) -> bool:
        """Whether the first projection gives [gate | up] rows (else the up rows alone)."""
        return self.kind != "relu2"

    def on_rows(self, h: torch.Tensor) -> torch.Tensor:
        """The activation of the first projection's output rows h [.., 2I] (gated) or [.., I]."""
        if not self.gated:
            return torch.relu(h).square()
        gate, up = h.chunk(2, dim=-1)
        return self(gate, up)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        if self.kind == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


SILU = ExpertActivation()


def fused_experts_ref(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: ExpertActivation = SILU,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """x [T, H]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; topk_weights [T, k]; topk_ids [T, k].
    Returns [T, H] in x's dtype (ungated activations: gate_up_proj [E, I, H]). FP8 experts (e4m3 projections with per-row scales [E, rows]) and MXFP4
    experts (uint8 [E, rows, in/2] with uint8 scales [E, rows, in/32]) are dequantized to x's dtype
    expert by expert. Biases (gpt-oss): gate_up_bias [E, 2I], down_bias [E, H],
    added before the activation and before the routing weight.

    The HF computation step for step (so fp32 results match it to the last bit on the same rows): each
    expert that was hit runs on its tokens in x's dtype, its output is scaled by the routing weight
    (cast to x's dtype) and added into the result. fp8_activations (FP8 experts; the fused kernels' W8A8
    arithmetic): each GEMM's input rows quantized per row (quant/fp8.quantize_activation_ref), the GEMMs
    in float32 on the dequantized values, the activation's output and each expert's rows rounded to
    x's dtype, as the kernels store them."""
    if fp8_activations:
        return _w8a8_experts_ref(
            x, gate_up_proj, down_proj, topk_weights, topk_ids, gate_up_scale, down_scale,
            gate_up_bias, down_bias, activation,
        )  # fmt: skip
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    ids = topk_ids.long()
    for expert in torch.unique(ids).tolist():
        token, slot = torch.where(ids == expert)
        w1, w2 = gate_up_proj[expert], down_proj[expert]
        if w1.dtype == torch.uint8 and gate_up_scale is not None and down_scale is not None:
            w1 = _mxfp4_rows(w1, gate_up_scale[expert], x.dtype)
            w2 = _mxfp4_rows(w2, down_scale[expert], x.dtype)
        elif gate_up_scale is not None and down_scale is not None:
            w1 = (w1.float() * gate_up_scale[expert, :, None]).to(x.dtype)
            w2 = (w2.float() * down_scale[expert, :, None]).to(x.dtype)
        b1 = None if gate_up_bias is None else gate_up_bias[expert]
        b2 = None if down_bias is None else down_bias[expert]
        h = activation.on_rows(F.linear(x[token], w1, b1))
        y = F.linear(h, w2, b2) * weights[token, slot, None]
        out.index_add_(0, token, y)
    return out


def runs_w8a8(weight: torch.Tensor) -> bool:
    """Whether experts stored as `weight` run W8A8 (module docstring): e4m3 experts on a GPU."""
    return weight.dtype == torch.float8_e4m3fn and weight.is_cuda


def _w8a8_experts_ref(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_scale: torch.Tensor | None,
    down_scale: torch.Tensor | None,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    activation: ExpertActivation,
) -> torch.Tensor:
    from overnight.quant.fp8 import quantize_activation_ref

    if gate_up_proj.dtype != torch.float8_e4m3fn or gate_up_scale is None or down_scale is None:
        raise ValueError("fp8_activations needs e4m3 experts with their row scales")

    def quantized(rows: torch.Tensor) -> torch.Tensor:
        data, scale = quantize_activation_ref(rows)
        return data.float() * scale

    out = torch.zeros_like(x)
    ids = topk_ids.long()
    for expert in torch.unique(ids).tolist():
        token, slot = torch.where(ids == expert)
        w1 = gate_up_proj[expert].float() * gate_up_scale[expert, :, None]
        w2 = down_proj[expert].float() * down_scale[expert, :, None]
        b1 = None if gate_up_bias is None else gate_up_bias[expert].float()
        b2 = None if down_bias is None else down_bias[expert].float()
        h = activation.on_rows(F.linear(quantized(x[token]), w1, b1)).to(x.dtype)
        y = F.linear(quantized(h), w2, b2) * topk_weights[token, slot, None].float()
        out.index_add_(0, token, y.to(x.dtype))
    return out


def _mxfp4_rows(rows: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from overnight.quant.mxfp4 import dequantize_mxfp4

    return dequantize_mxfp4(rows.unflatten(-1, (-1, 16)), scales, dtype)


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for each token: (weights [T, k] float32, ids [T, k] int32)."""
    if use_kernels(logits):
        from overnight.kernels.moe_router import router_topk  # triton loads on first use

        return router_topk(logits, top_k, renormalize)
    return router_topk_ref(logits, top_k, renormalize)


def run_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: ExpertActivation = SILU,
) -> torch.Tensor:
    """The experts' weighted sum for each token, on the path use_kernels(x) picks."""
    if use_kernels(x):
        from overnight.kernels.fused_moe import fused_experts  # triton loads on first use

        return fused_experts(
            x,
            gate_up_proj,
            down_proj,
            topk_weights,
            topk_ids,
            None,
            gate_up_scale,
            down_scale,
            gate_up_bias=gate_up_bias,
            down_bias=down_bias,
            activation=(activation.kind, activation.alpha, activation.limit),
            fp8_activations=runs_w8a8(gate_up_proj),
        )
    return fused_experts_ref(
        x,
        gate_up_proj,
        down_proj,
        topk_weights,
        topk_ids,
        gate_up_scale,
        down_scale,
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
        activation=activation,
        fp8_activations=runs_w8a8(gate_up_proj),
    )


class Experts(nn.Module):
    """num_experts gated MLPs of hidden_size -> intermediate_size -> hidden_size, stacked (ungated ones
    with an ungated activation: gate_up_proj then holds intermediate_size rows an expert).

    Tensor parallelism shrinks intermediate_size (each rank keeps every expert's slice of it) and sums
    the ranks' outputs from outside (parallel/tp.py)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        activation: ExpertActivation | str = SILU,
        mxfp4: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.activation = ExpertActivation(activation) if isinstance(activation, str) else activation
        first_rows = (2 if self.activation.gated else 1) * intermediate_size
        if mxfp4 and not self.activation.gated:
            raise ValueError("MXFP4 experts must be gated")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, first_rows, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # MXFP4 (gpt-oss's published experts, quant/mxfp4.py): kept packed on every device, two weights
        # a byte with one power-of-two scale per 32 inputs; the GPU kernels decode tiles in registers.
        self.gate_up_scales: nn.Parameter | None = None
        self.down_scales: nn.Parameter | None = None
        if mxfp4:
            e, i, h = num_experts, intermediate_size, hidden_size
            if h % 32 or i % 32:
                raise ValueError(
                    f"MXFP4 experts need hidden ({h}) and intermediate ({i}) sizes divisible by 32"
                )
            u8 = torch.uint8
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h // 2, dtype=u8), requires_grad=False)
            self.down_proj = nn.Parameter(torch.empty(e, h, i // 2, dtype=u8), requires_grad=False)
            self.gate_up_scales = nn.Parameter(torch.empty(e, 2 * i, h // 32, dtype=u8), requires_grad=False)
            self.down_scales = nn.Parameter(torch.empty(e, h, i // 32, dtype=u8), requires_grad=False)
        # Biases (gpt-oss): one per expert and output row, kept in the compute dtype under FP8.
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, first_rows)) if bias else None
        self.down_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        self._init_fp8_state()

    def _init_fp8_state(self) -> None:
        self.gate_up_scale: torch.Tensor | None = None  # FP8: [E, 2I] float32 (quantize_fp8_)
        self.down_scale: torch.Tensor | None = None  # FP8: [E, H] float32
        self.compute_dtype: torch.dtype | None = None  # FP8: the projections' dtype before quantizing
        # Row scales rounded up to powers of two (quant/fp8.pow2_row_scales): set by store_fp8_ for
        # gpt-oss's MXFP4 experts, whose e2m1 values then requantize exactly.
        self.pow2_scales = False

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        mx = self.gate_up_scales is not None
        return run_experts(
            x,
            self.gate_up_proj,
            self.down_proj,
            topk_weights,
            topk_ids,
            self.gate_up_scales if mx else self.gate_up_scale,
            self.down_scales if mx else self.down_scale,
            gate_up_bias=self.gate_up_bias,
            down_bias=self.down_bias,
            activation=self.activation,
        )

    @property
    def stores_fp8(self) -> bool:
        """Whether the projections hold e4m3 values (after quantize_fp8_, or from store_fp8_ on)."""
        return self.gate_up_proj.dtype == torch.float8_e4m3fn

    def store_fp8_(self, pow2_scales: bool = False) -> None:
        """Hold the projections as e4m3 from now on (a model being built, on the meta device): loading
        then goes through load_fp8_rows_, and the compute-dtype stack never exists. MXFP4 experts stay
        as they are. pow2_scales: every row's scale a power of two (quant/fp8.pow2_row_scales)."""
        if self.gate_up_scales is not None or self.stores_fp8:
            return
        self.compute_dtype = self.gate_up_proj.dtype
        self.pow2_scales = pow2_scales
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(self, name)
            e4m3 = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
            setattr(self, name, nn.Parameter(e4m3, requires_grad=False))

    @torch.no_grad()
    def load_fp8_rows_(
        self, name: str, rows: torch.Tensor, expert: int | None = None, start: int = 0
    ) -> None:
        """Write float `rows` into e4m3 projection `name` ("gate_up_proj" or "down_proj") quantized per
        row, with their scales: the whole stack [E, N, K] (expert None), or expert `expert`'s rows
        start .. start + len(rows). The scales are allocated beside the weight on the first write."""
        from overnight.quant.fp8 import quantize_stacked_per_channel, quantize_weight_per_channel

        weight = getattr(self, name).data
        scale_name = name.replace("_proj", "_scale")
        scale = getattr(self, scale_name)
        if scale is None:
            scale = torch.ones(weight.shape[:2], dtype=torch.float32, device=weight.device)
            setattr(self, scale_name, scale)
        if expert is None:
            data, row_scale = quantize_stacked_per_channel(rows, self.pow2_scales)
            weight.copy_(data)
            scale.copy_(row_scale)
        else:
            data, row_scale = quantize_weight_per_channel(rows, self.pow2_scales)
            weight[expert].narrow(0, start, rows.shape[0]).copy_(data)
            scale[expert].narrow(0, start, rows.shape[0]).copy_(row_scale)

    @torch.no_grad()
    def load_fp8_scales_(
        self, name: str, scale: torch.Tensor, expert: int | None = None, start: int = 0
    ) -> None:
        """Row scales of e4m3 projection `name` loaded as they are from a checkpoint (its values copied
        into the weight beforehand: models/checkpoint.copy_weight): the whole stack's [E, rows]
        (expert None), or expert `expert`'s rows start .. start + len(scale)."""
        weight = getattr(self, name)
        fits = tuple(scale.shape) == tuple(weight.shape[:2]) if expert is None else scale.dim() == 1
        if not self.stores_fp8 or not fits:
            raise ValueError(
                f"{name} scales {list(scale.shape)} do not fit e4m3 experts {list(weight.shape)}"
            )
        scale_name = name.replace("_proj", "_scale")
        if getattr(self, scale_name) is None:
            full = torch.ones(weight.shape[:2], dtype=torch.float32, device=weight.device)
            setattr(self, scale_name, full)
        target = getattr(self, scale_name)
        if expert is not None:
            target = target[expert].narrow(0, start, scale.shape[0])
        target.copy_(scale)

    @torch.no_grad()
    def quantize_fp8_(self) -> None:
        """Replace the loaded projections by e4m3 values and one scale per expert and row (the
        per-channel rule of quant/fp8.py)."""
        from overnight.quant.fp8 import quantize_stacked_per_channel

        if self.gate_up_scale is not None or self.gate_up_scales is not None or self.stores_fp8:
            return  # already FP8, or MXFP4 (which stays as it is: a quarter of bf16's bytes already)
        self.compute_dtype = self.gate_up_proj.dtype
        for name in ("gate_up_proj", "down_proj"):
            data, scale = quantize_stacked_per_channel(getattr(self, name))
            setattr(self, name, nn.Parameter(data, requires_grad=False))
            setattr(self, name.replace("_proj", "_scale"), scale)

    @torch.no_grad()
    def dequantize_(self) -> None:
        """The inverse, for comparisons: projections dequantized back to the compute dtype."""
        if self.gate_up_scale is None or self.down_scale is None:
            return
        for name, scale in (("gate_up_proj", self.gate_up_scale), ("down_proj", self.down_scale)):
            w = getattr(self, name)
            dense = (w.float() * scale[:, :, None]).to(self.compute_dtype)
            setattr(self, name, nn.Parameter(dense, requires_grad=False))
        self.gate_up_scale = self.down_scale = None

    def extra_repr(self) -> str:
        e, rows, h = self.gate_up_proj.shape
        fp8 = ", fp8" if self.gate_up_scale is not None else ""
        inter = rows // 2 if self.activation.gated else rows
        ungated = "" if self.activation.gated else f", {self.activation.kind}"
        return f"num_experts={e}, hidden_size={h}, intermediate_size={inter}{ungated}{fp8}"
