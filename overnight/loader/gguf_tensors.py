"""The tensors of gguf_families.CONFIG_FAMILIES files under HF checkpoint names: per-layer name tables
(GGUF suffix -> HF suffix, as llama.cpp's converter and gguf-py's tensor map name them), and the tensors
that do not map one to one: stacked experts (ExpertStacks), DeepSeek's split kv_b (LatentPairs), and
vectors the checkpoint holds as rows (reshaped)."""

from __future__ import annotations

import numpy as np

from overnight.errors import ModelLoadError

# Per decoder layer: GGUF name suffix -> HF name suffix (stacked experts are handled apart).
_ATTENTION = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
}
_DENSE_MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
LAYER_NAMES = {
    "gpt-oss": {
        **_ATTENTION,
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
    },
    "qwen2moe": {
        **_ATTENTION,
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate_inp.weight": "mlp.gate.weight",
        "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
        "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
        # a layer the file keeps dense (mlp_only_layers)
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    },
    "olmoe": {
        **_ATTENTION,
        "attn_q_norm.weight": "self_attn.q_norm.weight",  # over the whole projection
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate_inp.weight": "mlp.gate.weight",
    },
    "seed_oss": {**_ATTENTION, "post_attention_norm.weight": "post_attention_layernorm.weight", **_DENSE_MLP},
    "ernie4_5": {**_ATTENTION, "ffn_norm.weight": "post_attention_layernorm.weight", **_DENSE_MLP},
    "ernie4_5-moe": {
        **_ATTENTION,
        "ffn_norm.weight": "post_attention_layernorm.weight",
        **_DENSE_MLP,  # the leading dense layers
        "ffn_gate_inp.weight": "mlp.gate.weight",
        "exp_probs_b.bias": "mlp.moe_statics.e_score_correction_bias",
        "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    },
    "exaone4": {  # post-norms only, per-head q/k norms
        **_ATTENTION,
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        **_DENSE_MLP,
    },
    # Cohere: one LayerNorm before attention and MLP side by side; Command R+'s per-head q/k norms
    "command-r": {
        **_ATTENTION,
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        **_DENSE_MLP,
    },
    "cohere2": {**_ATTENTION, **_DENSE_MLP},
    # LFM2: HF's own names (models/lfm2.py renames them as they load); the conv kernel is squeezed to
    # [channels, L] in the file (reshaped back by `reshaped`)
    "lfm2": {
        "attn_norm.weight": "operator_norm.weight",
        "ffn_norm.weight": "ffn_norm.weight",
        "shortconv.conv.weight": "conv.conv.weight",
        "shortconv.in_proj.weight": "conv.in_proj.weight",
        "shortconv.out_proj.weight": "conv.out_proj.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.out_proj.weight",
        "attn_q_norm.weight": "self_attn.q_layernorm.weight",
        "attn_k_norm.weight": "self_attn.k_layernorm.weight",
        "ffn_gate.weight": "feed_forward.w1.weight",
        "ffn_up.weight": "feed_forward.w3.weight",
        "ffn_down.weight": "feed_forward.w2.weight",
    },
    "deepseek2": {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_q_a.weight": "self_attn.q_a_proj.weight",
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn_kv_b.weight": "self_attn.kv_b_proj.weight",  # older files; newer split it (LatentPairs)
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate_inp.weight": "mlp.gate.weight",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
        "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",  # the leading dense layers
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    },
}


LAYER_NAMES["lfm2moe"] = {  # LFM2's, and the router with its bias (the leading layers keep LFM2's MLP)
    **LAYER_NAMES["lfm2"],
    "ffn_gate_inp.weight": "feed_forward.gate.weight",
    "exp_probs_b.bias": "feed_forward.expert_bias",
}
# Granite 4.0-H: the checkpoint's names (models/granite_hybrid.py renames them as they load); the
# converter permutes q/k rows as for llama (PERMUTED), turns A_log into A = -exp(A_log) and reshapes A,
# D and the gated norm (`reshaped` undoes both).
LAYER_NAMES["granitehybrid"] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.router.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.down_proj",
    "ffn_down_shexp.weight": "shared_mlp.output_linear.weight",
    "ffn_down.weight": "shared_mlp.output_linear.weight",  # a model without experts
    "ssm_in.weight": "mamba.in_proj.weight",
    "ssm_in.bias": "mamba.in_proj.bias",
    "ssm_conv1d.weight": "mamba.conv1d.weight",
    "ssm_conv1d.bias": "mamba.conv1d.bias",
    "ssm_dt.bias": "mamba.dt_bias",
    "ssm_a": "mamba.A_log",
    "ssm_d": "mamba.D",
    "ssm_norm.weight": "mamba.norm.weight",
    "ssm_out.weight": "mamba.out_proj.weight",
    "ssm_out.bias": "mamba.out_proj.bias",
}
# Nemotron-H: its converter is Granite 4.0-H's (the same Mamba2 forms and q/k permutation)
LAYER_NAMES["nemotron_h"] = {
    "attn_norm.weight": "norm.weight",
    "attn_q.weight": "mixer.q_proj.weight",
    "attn_k.weight": "mixer.k_proj.weight",
    "attn_v.weight": "mixer.v_proj.weight",
    "attn_output.weight": "mixer.o_proj.weight",
    "ffn_up.weight": "mixer.up_proj.weight",
    "ffn_down.weight": "mixer.down_proj.weight",
    **{
        k: v.replace("mamba.", "mixer.")
        for k, v in LAYER_NAMES["granitehybrid"].items()
        if k.startswith("ssm_")
    },
}
PERMUTED = ("granitehybrid", "nemotron_h")  # q/k rows in llama.cpp's interleaved-RoPE order
# Tensors the checkpoint holds fused that the converter split in two: GGUF suffix -> (HF name, which
# half, axis); the first half waits for the second (HalfPairs).
HALF_PAIRS = {
    "granitehybrid": {
        "ffn_gate_exps.weight": ("block_sparse_moe.experts.gate_up_proj", 0, 1),
        "ffn_up_exps.weight": ("block_sparse_moe.experts.gate_up_proj", 1, 1),
        "ffn_gate_shexp.weight": ("shared_mlp.input_linear.weight", 0, 0),
        "ffn_up_shexp.weight": ("shared_mlp.input_linear.weight", 1, 0),
        "ffn_gate.weight": ("shared_mlp.input_linear.weight", 0, 0),
        "ffn_up.weight": ("shared_mlp.input_linear.weight", 1, 0),
    }
}
# Whole-model tensors named apart from gguf.py's _GLOBAL_NAMES: LFM2's final norm sits by the embedding.
_LFM2_GLOBALS = {"token_embd_norm.weight": "model.embedding_norm.weight"}
GLOBAL_NAMES = {
    "lfm2": _LFM2_GLOBALS,
    "lfm2moe": _LFM2_GLOBALS,
    "nemotron_h": {
        "token_embd.weight": "model.embeddings.weight",
        "output_norm.weight": "model.norm_f.weight",
    },
}


class ExpertStacks:
    """Stacked expert tensors ([E, out, in] weights, [E, out] biases) -> HF per-expert names.

    Weights become mlp.experts.{e}.{gate,up,down}_proj.weight. Biases (gpt-oss) have no per-expert
    checkpoint form: they go whole to the experts' stacked parameters, mlp.experts.gate_up_bias
    ([E, 2I]: gate then up) and mlp.experts.down_bias; a file with separate gate and up biases has the
    first held here until the second arrives."""

    _SUFFIXES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")

    def __init__(self) -> None:
        self._half_biases: dict[str, dict[str, np.ndarray]] = {}  # layer prefix -> {"gate"|"up": [E, I]}
        self._half_packed: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}  # -> (blocks, scales)

    @classmethod
    def handles(cls, suffix: str) -> bool:
        return suffix.rpartition(".")[0] in cls._SUFFIXES

    def tensors(self, layer: str, suffix: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """HF (name, array) pairs for the stacked tensor `suffix` of layer `layer`, possibly none yet."""
        stem, _, kind = suffix.rpartition(".")
        proj = stem.removeprefix("ffn_").removesuffix("_exps")  # gate / up / down / gate_up
        prefix = f"model.layers.{layer}.mlp.experts"
        if kind == "weight":
            if proj == "gate_up":  # gate rows, then up rows
                gate, up = np.split(w, 2, axis=1)
                return [
                    *((f"{prefix}.{e}.gate_proj.weight", gate[e]) for e in range(w.shape[0])),
                    *((f"{prefix}.{e}.up_proj.weight", up[e]) for e in range(w.shape[0])),
                ]
            return [(f"{prefix}.{e}.{proj}_proj.weight", w[e]) for e in range(w.shape[0])]
        if kind != "bias":
            raise ModelLoadError(f"unexpected GGUF tensor blk.{layer}.{suffix}")
        if proj in ("down", "gate_up"):
            return [(f"{prefix}.{proj}_bias", w)]
        halves = self._half_biases.setdefault(prefix, {})
        halves[proj] = w
        if len(halves) < 2:
            return []
        del self._half_biases[prefix]
        return [(f"{prefix}.gate_up_bias", np.concatenate([halves["gate"], halves["up"]], axis=1))]

    def packed(self, layer: str, suffix: str, raw: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """gpt-oss's MXFP4 expert weights kept packed: ggml's blocks -> the published checkpoint's
        <proj>_blocks [E, out, in/32, 16] and <proj>_scales [E, out, in/32] (gate and up rows
        interleaved, gate first, as models/gpt_oss.py takes them). `raw` is the tensor's bytes as
        [E, out, in/32 * 17]; separate gate and up tensors wait here for each other."""
        proj = suffix.rpartition(".")[0].removeprefix("ffn_").removesuffix("_exps")
        prefix = f"model.layers.{layer}.mlp.experts"
        blocks, scales = mxfp4_to_checkpoint(raw)
        if proj == "down":
            return [(f"{prefix}.down_proj_blocks", blocks), (f"{prefix}.down_proj_scales", scales)]
        if proj == "gate_up":  # gate rows, then up rows
            gate, up = (np.split(blocks, 2, axis=1), np.split(scales, 2, axis=1))
            halves = {"gate": (gate[0], up[0]), "up": (gate[1], up[1])}
        else:
            pending = self._half_packed.setdefault(prefix, {})
            pending[proj] = (blocks, scales)
            if len(pending) < 2:
                return []
            halves = self._half_packed.pop(prefix)
        out = []
        for i, kind in enumerate(("blocks", "scales")):
            g, u = halves["gate"][i], halves["up"][i]
            both = np.empty((g.shape[0], 2 * g.shape[1], *g.shape[2:]), dtype=np.uint8)
            both[:, 0::2], both[:, 1::2] = g, u
            out.append((f"{prefix}.gate_up_proj_{kind}", both))
        return out

    def check_done(self, path: str) -> None:
        if self._half_biases:
            lonely = sorted(f"{p}: {', '.join(h)} bias only" for p, h in self._half_biases.items())
            raise ModelLoadError(f"{path}: expert gate and up biases come in pairs ({'; '.join(lonely)})")
        if self._half_packed:
            lonely = sorted(f"{p}: {', '.join(h)} only" for p, h in self._half_packed.items())
            raise ModelLoadError(f"{path}: expert gate and up weights come in pairs ({'; '.join(lonely)})")


def mxfp4_to_checkpoint(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml MXFP4 rows [..., G * 17] -> (blocks [..., G, 16], scales [..., G]) in the OCP checkpoints'
    layout. Both store 32 e2m1 codes and one e8m0 scale a block, with the same code and scale meaning;
    ggml puts the scale byte first and codes 0..15 in the low nibbles, 16..31 in the high ones, the
    checkpoints codes 2j and 2j+1 in byte j's low and high nibble:

        ggml   [e | q0+q16<<4 | q1+q17<<4 | ... | q15+q31<<4]
        HF     scales[g] = e,  blocks[g] = [q0+q1<<4 | q2+q3<<4 | ... | q30+q31<<4]
    """
    blocks = raw.reshape(*raw.shape[:-1], -1, 17)
    qs = blocks[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [..., G, 32] in element order
    return codes[..., 0::2] | (codes[..., 1::2] << 4), np.ascontiguousarray(blocks[..., 0])


class HalfPairs:
    """HALF_PAIRS' tensors put back together: gate then up, along the pair's axis."""

    def __init__(self, table: dict[str, tuple[str, int, int]]) -> None:
        self.table = table
        self._halves: dict[str, dict[int, np.ndarray]] = {}

    def tensors(self, layer: str, suffix: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
        target, half, axis = self.table[suffix]
        name = f"model.layers.{layer}.{target}"
        halves = self._halves.setdefault(name, {})
        halves[half] = w
        if len(halves) < 2:
            return []
        del self._halves[name]
        return [(name, np.concatenate([halves[0], halves[1]], axis=axis))]

    def check_done(self, path: str) -> None:
        if self._halves:
            raise ModelLoadError(
                f"{path}: gate and up tensors come in pairs ({', '.join(sorted(self._halves))} lack one)"
            )


class LatentPairs:
    """DeepSeek's kv_b_proj from newer converters' split form: attn_k_b [H, kv_lora_rank, nope] (each
    head's key rows, transposed) and attn_v_b [H, v_head_dim, kv_lora_rank]; the checkpoint's kv_b_proj
    is [H * (nope + v_head_dim), kv_lora_rank], each head's key rows then its value rows. The first of
    a layer's pair waits here for the second."""

    _SUFFIXES = ("attn_k_b.weight", "attn_v_b.weight")

    def __init__(self) -> None:
        self._halves: dict[str, dict[str, np.ndarray]] = {}

    @classmethod
    def handles(cls, suffix: str) -> bool:
        return suffix in cls._SUFFIXES

    def tensors(self, layer: str, suffix: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
        halves = self._halves.setdefault(layer, {})
        halves[suffix[5]] = w  # "k" or "v"
        if len(halves) < 2:
            return []
        del self._halves[layer]
        k_b, v_b = halves["k"], halves["v"]
        if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
            raise ModelLoadError(
                f"blk.{layer}.attn_k_b {list(k_b.shape)} and attn_v_b {list(v_b.shape)} do not pair up "
                "as [heads, kv_lora_rank, nope] and [heads, v_head_dim, kv_lora_rank]"
            )
        kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])
        return [(f"model.layers.{layer}.self_attn.kv_b_proj.weight", kv_b)]

    def check_done(self, path: str) -> None:
        if self._halves:
            lonely = sorted(f"blk.{layer}: attn_{''.join(h)}_b only" for layer, h in self._halves.items())
            raise ModelLoadError(f"{path}: attn_k_b and attn_v_b come in pairs ({'; '.join(lonely)})")


def reshaped(hf: str, w: np.ndarray) -> np.ndarray:
    """The checkpoint's shape where a file holds a vector: Qwen2-MoE's shared expert gate is [1, H], ERNIE
    4.5's correction bias [1, E]; LFM2's conv kernel [C, 1, L]."""
    if hf.endswith(("shared_expert_gate.weight", "moe_statics.e_score_correction_bias")) and w.ndim == 1:
        return w[None, :]
    if hf.endswith(("conv.conv.weight", "conv1d.weight")) and w.ndim == 2:  # depthwise kernels: [C, 1, L]
        return w[:, None, :]
    if hf.endswith((".mamba.A_log", ".mixer.A_log")):  # the file holds A = -exp(A_log), [heads, 1]
        return np.log(-w.astype(np.float64)).astype(np.float32).reshape(-1)
    if hf.endswith(
        ("mamba.D", "mamba.norm.weight", "mixer.D", "mixer.norm.weight")
    ):  # [H, 1]; [G, inner / G]
        return w.reshape(-1)
    return w
