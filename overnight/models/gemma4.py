"""Gemma 4 (text; also the language model of Gemma4ForConditionalGeneration checkpoints), dense and
mixture-of-experts (26B-A4B), as HF's modeling_gemma4.py computes it.

Per layer i, of kind full or sliding (ModelArch.layer_window), with that kind's head size, KV heads and
rotary table (full layers: global_head_dim, num_global_key_value_heads, proportional RoPE):

    q = rope(q_norm(q_proj(y)));  k = rope(k_norm(k_proj(y)));  v = v_norm(v_proj(y))   (y = input_layernorm(x))
        attention_k_eq_v: full layers have no v_proj, v = v_norm(k_proj(y)) (k before its norm);
        KV-shared layers (the last num_kv_shared_layers) have only q: they read the cache of the last
        earlier layer of their kind (kv_source_layer), which this step already wrote;
        scores are not scaled (scale 1.0: q_norm sets the size), no softcap.
    x = x + post_attention_layernorm(o_proj(attention))
    m = mlp(pre_feedforward_layernorm(x))                     (GeGLU; twice as wide in KV-shared layers
                                                               with use_double_wide_mlp)
    MoE: m = post_feedforward_layernorm_1(m)
           + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(x), router(x)))
    x = x + post_feedforward_layernorm(m)
    per-layer input (hidden_size_per_layer_input > 0):
        x = x + post_per_layer_input_norm(per_layer_projection(gelu(per_layer_input_gate(x)) * p_i))
    x = x * layer_scalar

The router: scaleless norm of x, times its `scale` and hidden ** -0.5, a linear to E logits, softmax,
top k renormalised to 1, times per_expert_scale of the chosen experts. p_i (the per-layer inputs) come
from the token ids and the embeddings:

    p = (norm(per_layer_model_projection(e) * hidden ** -0.5) + embed_tokens_per_layer(ids) * sqrt(P)) / sqrt(2)

split into num_hidden_layers slices of P. Norms use their weight as stored (no 1 + w, unlike Gemma 2/3).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.attention.spec import LayerAttention
from overnight.errors import ModelLoadError
from overnight.layers.gemma import GemmaRotaryEmbedding, ScalelessRMSNorm, softcap
from overnight.layers.moe import Experts, select_experts
from overnight.layers.norm import RMSNorm
from overnight.models.checkpoint import copy_weight
from overnight.models.gemma import GemmaMLP, embed_scale, layer_kind, rotary_tables, text_weights
from overnight.models.llama import PACKED_MODULES_MAPPING, make_lm_head

# A fused projection's parts: checkpoint projection -> (fused parameter's module, first row, rows).
FusedShards = dict[str, tuple[str, int, int]]


class Gemma4Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rotary_emb: GemmaRotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.layer_num_kv_heads(layer_idx)
        self.head_dim = d = arch.layer_head_dim(layer_idx)
        self.layer = LayerAttention(arch.layer_window(layer_idx), None)
        self.kv_source = arch.kv_source_layer(layer_idx)
        self.is_kv_shared = self.kv_source != layer_idx
        self.k_eq_v = arch.attention_k_eq_v and arch.layer_window(layer_idx) is None
        q, kv, h = self.num_heads * d, self.num_kv_heads * d, arch.hidden_size
        self.q_norm = RMSNorm(d, eps=arch.rms_norm_eps)
        self.fused_shards: FusedShards = {}
        if self.is_kv_shared:
            self.q_proj = nn.Linear(h, q, bias=arch.attention_bias)
        else:
            parts = [("q_proj", q), ("k_proj", kv)] + ([] if self.k_eq_v else [("v_proj", kv)])
            start = 0
            for name, rows in parts:
                self.fused_shards[name] = ("qkv_proj", start, rows)
                start += rows
            self.qkv_proj = nn.Linear(h, start, bias=arch.attention_bias)
            self.k_norm = RMSNorm(d, eps=arch.rms_norm_eps)
            self.v_norm = ScalelessRMSNorm(eps=arch.rms_norm_eps)
        self.o_proj = nn.Linear(q, h, bias=arch.attention_bias)
        self.rotary_emb = rotary_emb

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        if self.is_kv_shared:
            q = self.rotary_emb.rotate_q(positions, self.q_norm(self.q_proj(x).view(n, -1, d)))
            # Read under the source layer's index: its cache and, for an FP8 cache, the scales it was
            # written with (a shared layer's own row of kv_scales is never calibrated).
            o = attn(self.kv_source, q, None, None, 1.0, layer=self.layer)
            return self.o_proj(o.flatten(1))
        sizes = [rows for _, _, rows in self.fused_shards.values()]
        q, k, *rest = self.qkv_proj(x).split(sizes, dim=-1)
        q, k = q.view(n, -1, d), k.view(n, -1, d)
        # v is normalised before the rotation, which may turn k in place (the kernel path) and k is v's
        # source when attention_k_eq_v.
        v = self.v_norm(rest[0].view(n, -1, d) if rest else k)
        q, k = self.rotary_emb(positions, q, k, q_norm=self.q_norm, k_norm=self.k_norm)
        o = attn(self.layer_idx, q, k, v, 1.0, layer=self.layer)
        return self.o_proj(o.flatten(1))


class Gemma4Router(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.root_size = arch.hidden_size**-0.5
        self.norm = ScalelessRMSNorm(eps=arch.rms_norm_eps)
        self.proj = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(arch.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(arch.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k] int32)."""
        logits = self.proj(self.norm(x) * self.scale * self.root_size)
        weights, ids = select_experts(logits, self.top_k, renormalize=True)
        return weights * self.per_expert_scale[ids.long()], ids


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rotary_emb: GemmaRotaryEmbedding) -> None:
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.self_attn = Gemma4Attention(arch, layer_idx, rotary_emb)
        self.mlp = GemmaMLP(h, arch.layer_intermediate_size(layer_idx))
        self.input_layernorm = RMSNorm(h, eps=eps)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps=eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.is_moe = arch.is_moe_layer(layer_idx)
        if self.is_moe:
            self.router = Gemma4Router(arch)
            self.experts = Experts(arch.num_experts, h, arch.moe_intermediate_size, activation="gelu_tanh")
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps=eps)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps=eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps=eps)
        self.has_per_layer_input = arch.hidden_size_per_layer_input > 0
        if self.has_per_layer_input:
            ple = arch.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(h, ple, bias=False)
            self.per_layer_projection = nn.Linear(ple, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps=eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        attn: AttentionBatch,
    ) -> torch.Tensor:
        h = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), attn))
        h, x = self.pre_feedforward_layernorm(h, x)  # (norm(x + attention), x + attention)
        m = self.mlp(h)
        if self.is_moe:
            weights, ids = self.router(x)
            routed = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(m)
        if per_layer_input is not None:
            g = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.hidden_size = arch.hidden_size
        self.num_layers = arch.num_hidden_layers
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        head_dims = {
            "sliding_attention": arch.head_dim,
            "full_attention": arch.global_head_dim or arch.head_dim,
        }
        tables = rotary_tables(arch, head_dims)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(arch, i, tables[layer_kind(arch, i)]) for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.per_layer_size = ple = arch.hidden_size_per_layer_input
        if ple:
            n = arch.num_hidden_layers
            self.embed_tokens_per_layer = nn.Embedding(arch.vocab_size_per_layer_input, n * ple)
            self.per_layer_model_projection = nn.Linear(arch.hidden_size, n * ple, bias=False)
            self.per_layer_projection_norm = RMSNorm(ple, eps=arch.rms_norm_eps)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, num_layers, P]: each layer's input from the token ids and the (scaled) embeddings."""
        shape = (input_ids.shape[0], self.num_layers, self.per_layer_size)
        table = self.embed_tokens_per_layer(input_ids)
        by_token = (table * embed_scale(self.per_layer_size, table.dtype)).view(shape)
        projected = self.per_layer_model_projection(embeds) * self.hidden_size**-0.5
        return (self.per_layer_projection_norm(projected.view(shape)) + by_token) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * embed_scale(self.hidden_size, x.dtype)
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer_size else None
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, None if per_layer is None else per_layer[:, i], attn)
        return self.norm(x)


class Gemma4ForCausalLM(nn.Module):
    # Projections fuse per layer (Gemma4Attention.fused_shards, the MLP's gate/up), with each layer's
    # own sizes: load_weights places the checkpoint's separate tensors. The mapping names the fused
    # modules' parts for quantization (quant/); its shard ids are not used here.
    packed_modules_mapping = PACKED_MODULES_MAPPING
    # With FP8 weights the router stays in the compute dtype (its top-k decides which experts run), as
    # for Qwen3-MoE; the stacked experts are e4m3 from the build on, each checkpoint stack quantized per
    # row as it loads (layers/moe.py store_fp8_; the compute-dtype stack is never held).
    unquantized_linear: tuple[str, ...] = ("router.proj",)

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = Gemma4Model(arch)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(self.lm_head(hidden), self.arch.final_logit_softcapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_fused_weights(self, text_weights(weights))


def _targets(model: nn.Module) -> dict[str, tuple[str, int | None, int | None]]:
    """checkpoint tensor -> (parameter, first row, rows); rows None: the whole parameter. A quantized
    fused layer (quant/) takes each part's rows of every per-row tensor: an FP8 or W8A8 weight and its
    weight_scale, packed integer codes (packed_weight) with their group_scale and group_zero."""
    targets: dict[str, tuple[str, int | None, int | None]] = {}
    fused: set[str] = set()
    for mname, module in model.named_modules():
        shards: FusedShards = getattr(module, "fused_shards", {})
        if isinstance(module, GemmaMLP):
            rows = module.gate_up_proj.out_features // 2
            shards = {"gate_proj": ("gate_up_proj", 0, rows), "up_proj": ("gate_up_proj", rows, rows)}
        for proj, (attr, start, rows) in shards.items():
            layer_params = dict(getattr(module, attr).named_parameters(recurse=False))
            kinds = [kind for kind in layer_params if kind != "bias"]
            for kind in kinds:
                targets[f"{mname}.{proj}.{kind}"] = (f"{mname}.{attr}.{kind}", start, rows)
                fused.add(f"{mname}.{attr}.{kind}")
    for pname, _ in model.named_parameters():
        if pname not in fused:
            targets[pname] = (pname, None, None)
    return targets


@torch.no_grad()
def load_fused_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into `model`, placing separate q/k/v and gate/up tensors into each layer's
    fused parameter at that layer's own offsets. Raises ModelLoadError naming missing or unexpected
    tensors, and the first shape mismatch."""
    params = dict(model.named_parameters())
    targets = _targets(model)
    arch = model.arch
    assert isinstance(arch, ModelArch)
    seen: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and arch.tie_word_embeddings):
            continue
        if name not in targets:
            unexpected.append(name)
            continue
        pname, start, rows = targets[name]
        target = params[pname].data
        if start is not None and rows is not None:
            target = target.narrow(0, start, rows)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"shape mismatch for tensor {name}: checkpoint has {list(tensor.shape)}, "
                f"the model expects {list(target.shape)} (does config.json match the weights?)"
            )
        copy_weight(model, name, pname, target, tensor)  # e4m3 experts: quantized per row
        seen.add(name)
    problems = []
    missing = sorted(set(targets) - seen)
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(sorted(unexpected)[:8])}")
    if problems:
        raise ModelLoadError(
            f"checkpoint does not match the {type(model).__name__} architecture: " + "; ".join(problems)
        )
