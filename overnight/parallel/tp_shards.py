"""Tensor parallelism's sharding rules (TPShards): which rows and columns of every weight each rank keeps.

How one rank r of `world` holds a decoder (the model files stay unaware of it):

    qkv_proj    rows [q | k | v]     -> [q heads of r | kv heads of r | kv heads of r]   column-parallel
    o_proj      columns of r's q heads; partial outputs all-reduced, bias added once   row-parallel
    gate_up     rows [gate | up]     -> [gate rows of r | up rows of r]                 column-parallel
    down_proj   columns of r's intermediate slice; all-reduced                          row-parallel
    experts     every expert's gate/up rows (ungated: up rows) and down columns of r's slice of the
                expert intermediate size (like gate_up / down_proj); the weighted sum all-reduced;
                biases, MXFP4 blocks and scales with their rows and columns (parallel/tp_experts.py)
    shared experts  (Qwen3-Next's shared_expert, GLM-4.5's shared_experts) their gate/up rows and
                down columns of r's slice of shared_expert_intermediate_size
    router      (mlp.gate, mlp.router; GLM-4.5's correction bias) replicated: every rank routes
                every token the same way
    sinks       (gpt-oss) one per attention head: r's heads
    embed       vocab rows of r (ids elsewhere give zeros); all-reduced                 vocab-parallel
    lm_head     vocab rows of r; logits all-gathered, so every rank sees the whole vocabulary
    q_norm/k_norm   per-head ones replicated; the whole-projection ones (qk_norm_whole: OLMo 2/3,
                MiniMax-M2) take the rows of r's heads, and each token's sums of squares of q and k are
                all-reduced as one [tokens, 2] float32 tensor before the mean (layers/norm.py
                sharded_rms_norm_pair)
    other norms, rotary table: replicated

Hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) add their Gated DeltaNet layers' rules: parallel/tp_hybrid.py;
the Mamba2 hybrids (Granite 4.0-H, Nemotron-H, Falcon-H1) their mixers' heads and B/C groups, and Nemotron 3's
MoE blocks their one all-reduce of routed + shared: parallel/tp_mamba2.py.
Gemma 4's per-layer head sizes, KV heads and MLP widths: parallel/tp_gemma4.py. Latent attention
(DeepSeek-V2 / V3) by heads, its latent cache replicated: parallel/tp_mla.py.

KV heads: with num_kv_heads >= world each rank holds num_kv_heads / world of them; with fewer, each
group of world / num_kv_heads ranks holds one shared head. Either way a rank's KV pool holds exactly the
heads its own q heads read. The vocabulary is padded to a multiple of world with zero rows, trimmed again
after the gather.

The same TPShards.shard() slices checkpoint tensors (q_proj, gate_proj, ...) and the model's fused
parameters (qkv_proj, gate_up_proj), so weights can be sharded after loading (parallel/tp.py apply_tp on
a loaded model) or while loading (parallel/tp_load.py load_sharded_model, which never holds a whole
model on one device).

Integer layers (packed W4A16 / W8A16, W8A8) and packed integer experts shard by the rules of
parallel/tp_int.py.

FP8 layers (quant/linear.py) shard the same way: their scales have one row per output row, so a
column-parallel slice takes the rows of the scales with the rows of the weight; a row-parallel layer
keeps every per-channel scale (its outputs are whole rows) and takes the column blocks of block scales,
which needs each rank's columns to be whole blocks. Each rank quantizes its own share of a row-parallel
layer's input, so its per-token scales are those of its share.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.parallel.tp_experts import MXFP4_GROUP, shard_expert_tensor
from overnight.parallel.tp_gemma4 import gemma4_problems, is_gemma4, shard_gemma4_tensor
from overnight.parallel.tp_hybrid import VISION_TOWER, shard_hybrid_tensor
from overnight.parallel.tp_int import INT_PACKED_PARTS, int_row_columns
from overnight.parallel.tp_mamba2 import local_mamba2_arch, mamba2_problems, shard_mamba2_tensor
from overnight.parallel.tp_mla import shard_mla_tensor
from overnight.quant.fp8 import columns_per_scale

# Row-parallel projections: module name -> the column-parallel section whose output they read.
ROW_PARALLEL = {"o_proj": "q", "down_proj": "ffn"}
VOCAB_PARALLEL = ("embed_tokens", "embeddings", "lm_head")  # embeddings: Nemotron-H's input embedding
# The image models' vision towers and projectors (Qwen's visual.*, Gemma 3's, Mistral 3's and InternVL's
# vision_tower.*, Llama 4's and Idefics3's vision_model.*, multi_modal_projector.* and Idefics3's
# connector.*): replicated, never sharded;
# their own q_proj / o_proj / down_proj are not the decoder's.
TOWER_MODULES = frozenset(
    (VISION_TOWER, "vision_tower", "vision_model", "multi_modal_projector", "connector")
)


@dataclass(frozen=True)
class TPShards:
    """Which rows and columns of each weight rank `rank` of `world` keeps."""

    arch: ModelArch  # the whole model's
    rank: int
    world: int

    def check(self) -> None:
        a, w = self.arch, self.world
        # LFM2's short convs: in_proj's B | C | x thirds and the conv channels would split by rank, but
        # the state cache sizes a conv state by the whole hidden_size; refused until that is sharded too.
        if a.is_short_conv and w > 1:
            raise ModelLoadError(
                f"tensor_parallel_size {w} is not supported yet for LFM2's short-conv layers: use 1 "
                "(data_parallel_size runs several copies)"
            )
        # Falcon-H1's norm before the gate (layers/mamba2.py) has no statistics summed over ranks: each
        # rank must hold whole norm slices.
        if a.mamba_rms_norm and a.mamba_norm_before_gate and w > 1 and a.mamba_norm_groups % w:
            raise ModelLoadError(
                f"tensor_parallel_size {w} is not supported yet for a Mamba2 norm before the gate "
                f"(mamba_norm_before_gate) over {a.mamba_norm_groups} group(s): use a size that divides them"
            )
        problems = gemma4_problems(a, w) if is_gemma4(a) else []
        if a.is_mamba2:
            problems += mamba2_problems(a, w)
        if a.num_attention_heads % w:
            problems.append(f"num_attention_heads {a.num_attention_heads}")
        hkv = a.num_key_value_heads
        # Either whole kv heads per rank, or whole groups of ranks per kv head.
        if (hkv % w) if hkv >= w else (w % hkv):
            problems.append(f"num_key_value_heads {hkv}")
        if a.intermediate_size % w:
            problems.append(f"intermediate_size {a.intermediate_size}")
        if a.num_experts and a.moe_intermediate_size % w and not a.experts_mxfp4:  # MXFP4: padded
            problems.append(f"moe_intermediate_size {a.moe_intermediate_size}")
        if a.shared_expert_intermediate_size % w:
            problems.append(f"shared_expert_intermediate_size {a.shared_expert_intermediate_size}")
        if a.num_linear_layers and a.linear_num_key_heads % w:  # value heads are a multiple of these
            problems.append(f"linear_num_key_heads {a.linear_num_key_heads} (linear-attention heads)")
        if problems:
            raise ModelLoadError(
                f"tensor_parallel_size {w} does not divide the model's {', '.join(problems)}"
            )
        groups = a.moe_intermediate_size // MXFP4_GROUP
        if a.experts_mxfp4 and groups < w:
            raise ModelLoadError(
                f"tensor_parallel_size {w} is more than the {groups} {MXFP4_GROUP}-column scale groups of "
                f"the MXFP4 experts' intermediate size {a.moe_intermediate_size}; use a smaller one"
            )
        # Apertus' ungated MLP (up_proj alone, and xIELU's per-layer scalars) has no column rule here.
        if a.hidden_act == "xielu" and w > 1:
            raise ModelLoadError(
                f"tensor_parallel_size {w} is not supported yet for Apertus (its ungated xIELU MLP): use 1"
            )
        # Command R+'s q / k LayerNorms hold a weight row per head, which no rule here splits yet.
        if a.qk_norm and a.norm_type == "layer" and w > 1:
            raise ModelLoadError(
                f"tensor_parallel_size {w} is not supported yet for Command R+'s per-head q/k LayerNorms "
                "(use_qk_norm): use 1"
            )

    @property
    def moe_share(self) -> int:
        """Units of every expert's intermediate size a rank holds. MXFP4 experts split in whole
        32-column scale groups: when the groups do not divide evenly, each rank holds
        ceil(groups / world) of them and the last ranks' tails are zero padding (zero gate/up rows
        and biases give a zero activation, and zero down columns add nothing: the sum is exact)."""
        a, w = self.arch, self.world
        if a.experts_mxfp4 and (a.moe_intermediate_size // w) % MXFP4_GROUP:
            return MXFP4_GROUP * -(-(a.moe_intermediate_size // MXFP4_GROUP) // w)
        return a.moe_intermediate_size // w

    @property
    def local_arch(self) -> ModelArch:
        """The shape of one rank's share; vocab_size stays whole, as the logits are gathered."""
        a, w = self.arch, self.world
        return replace(
            local_mamba2_arch(a, w) if a.is_mamba2 else a,
            num_attention_heads=a.num_attention_heads // w,
            num_key_value_heads=max(1, a.num_key_value_heads // w),
            intermediate_size=a.intermediate_size // w,
            moe_intermediate_size=self.moe_share,
            shared_expert_intermediate_size=a.shared_expert_intermediate_size // w,
            linear_num_key_heads=a.linear_num_key_heads // w,
            linear_num_value_heads=a.linear_num_value_heads // w,
            num_global_key_value_heads=max(1, a.num_global_key_value_heads // w)
            if a.num_global_key_value_heads
            else 0,
        )

    @property
    def rank_weights_arch(self) -> ModelArch:
        """local_arch with the vocab-parallel embedding's and LM head's vocab_per_rank rows: the shape of
        the weights one rank holds, for sizing its memory (replicated parts stay whole in it: norms,
        routers, row-parallel biases, a shared KV head, the vision tower). Not a model's arch: its
        logits are gathered over the whole vocabulary."""
        return replace(self.local_arch, vocab_size=self.vocab_per_rank)

    def section(self, name: str) -> tuple[int, int]:
        """(first row, rows) of this rank inside one whole section: "q", "kv", "ffn" (the dense MLP's
        intermediate size), "moe" (an expert's), "shared" (the shared expert's), or a Gated DeltaNet
        layer's "linear_k" (key heads x dk), "linear_v" (value heads x dv), "linear_heads" (value heads)."""
        a, w, r = self.arch, self.world, self.rank
        linear = {
            "linear_k": (a.linear_num_key_heads, a.linear_key_head_dim),
            "linear_v": (a.linear_num_value_heads, a.linear_value_head_dim),
            "linear_heads": (a.linear_num_value_heads, 1),
        }
        if name in linear:
            heads, size = linear[name]
            per = heads // w * size
            return r * per, per
        if name == "q":
            per = a.q_size // w
            return r * per, per
        if name == "kv":
            hkv = a.num_key_value_heads
            head = r * hkv // w  # with hkv < w, ranks r*hkv//w share one head
            n = max(1, hkv // w)
            return head * a.head_dim, n * a.head_dim
        if name == "moe":  # may run past the whole size: padding (moe_share)
            return r * self.moe_share, self.moe_share
        per = (a.shared_expert_intermediate_size if name == "shared" else a.intermediate_size) // w
        return r * per, per

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.arch.vocab_size // self.world)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def shard(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's share of the whole tensor `name` (a checkpoint or a model parameter name).
        May be a view of `t`; callers that keep it clone it."""
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
        a = self.arch
        if not TOWER_MODULES.isdisjoint(parts):  # replicated: every rank runs the whole tower
            return t
        # a checkpoint's per-expert tensors: experts.N.*; the hybrids' shared expert: shared_expert.*,
        # GLM-4.5's shared experts: shared_experts.*
        shared = "shared_expert" in parts or "shared_experts" in parts
        ffn = "moe" if "experts" in parts else "shared" if shared else "ffn"
        if is_gemma4(a):  # per-layer head sizes and widths: tp_gemma4.py
            per_layer = shard_gemma4_tensor(a, self.rank, self.world, parts, t)
            if per_layer is not None:
                return per_layer
        if a.is_mla:
            latent = shard_mla_tensor(a, self.rank, self.world, module, kind, t)
            if latent is not None:
                return latent
        if a.is_mamba2:
            mamba2 = shard_mamba2_tensor(a, self.rank, self.world, self.section("ffn"), parts, t)
            if mamba2 is not None:
                return mamba2
        elif a.num_linear_layers:
            linear = shard_hybrid_tensor(a, self.rank, self.world, self.section, module, kind, t)
            if linear is not None:
                return linear
        expert = shard_expert_tensor(
            self.section("moe"), a.moe_intermediate_size, self.rank, parts, t, a.experts_gated
        )  # stacked or per-expert, gated or not: tp_experts.py
        if expert is not None:
            return expert
        if kind == "sinks":  # one learned sink per attention head (gpt-oss)
            start, n = self.section("q")
            return t.narrow(0, start // a.head_dim, n // a.head_dim)
        if module == "qkv_proj":
            q, k, v = t.split([a.q_size, a.kv_size, a.kv_size])
            return torch.cat([self._rows(q, "q"), self._rows(k, "kv"), self._rows(v, "kv")])
        if module == "gate_up_proj":
            gate, up = t.split([a.intermediate_size, a.intermediate_size])
            return torch.cat([self._rows(gate, "ffn"), self._rows(up, "ffn")])
        if module in ("q_norm", "k_norm") and a.qk_norm_whole:  # OLMo: one weight per q / k channel
            return self._rows(t, "q" if module == "q_norm" else "kv")
        if module == "q_proj":
            return self._rows(t, "q")
        if module in ("k_proj", "v_proj"):
            return self._rows(t, "kv")
        if module in ("gate_proj", "up_proj"):
            return self._rows(t, ffn)
        if module in ROW_PARALLEL and kind == "weight":
            start, n = self.section(ffn if module == "down_proj" else ROW_PARALLEL[module])
            return t.narrow(1, start, n)
        if module in ROW_PARALLEL and kind in INT_PACKED_PARTS:  # packed integer layers: tp_int.py
            start, n = self.section(ffn if module == "down_proj" else ROW_PARALLEL[module])
            return int_row_columns(module, kind, t, start, n, self.world)
        if module in ROW_PARALLEL and kind == "weight_scale" and t.dim() == 2:
            return self._column_blocks(module, t, ffn if module == "down_proj" else ROW_PARALLEL[module])
        if module in VOCAB_PARALLEL and kind == "weight":
            rows = t.narrow(
                0, self.vocab_start, max(0, min(self.vocab_per_rank, a.vocab_size - self.vocab_start))
            )
            if rows.shape[0] < self.vocab_per_rank:
                pad = t.new_zeros(self.vocab_per_rank - rows.shape[0], *t.shape[1:])
                rows = torch.cat([rows, pad])
            return rows
        return t  # norms, row-parallel biases (added once, after the reduce)

    def _rows(self, t: torch.Tensor, section: str) -> torch.Tensor:
        start, n = self.section(section)
        return t.narrow(0, start, n)

    def _column_blocks(self, module: str, scale: torch.Tensor, section: str) -> torch.Tensor:
        """This rank's columns of a row-parallel layer's block scales [N, KB], its input the `section`
        ("q", "ffn", or a shared expert's "shared")."""
        a = self.arch
        whole = {"q": a.q_size, "shared": a.shared_expert_intermediate_size}.get(section, a.intermediate_size)
        block = columns_per_scale(whole, scale.shape[1])
        start, n = self.section(section)
        if start % block or n % block:
            raise ModelLoadError(
                f"tensor_parallel_size {self.world} splits the input of {module} ({whole} columns) into "
                f"shares of {n}, which are not whole {block}-column weight-scale blocks; use a smaller "
                "tensor_parallel_size, or a checkpoint without block scales"
            )
        return scale.narrow(1, start // block, n // block)
