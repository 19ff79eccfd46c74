"""Which checkpoint projections an adapter may target on each family, and where each lands in our model.

Our decoder layers fuse q/k/v into self_attn.qkv_proj and gate/up into mlp.gate_up_proj (MODULE_SLICES
lists each wrapped module's output slices, in its fused row order). A checkpoint projection is then
    a slice of one module:     q_proj -> qkv_proj slice 0, up_proj -> gate_up_proj slice 1, ...
    a whole fused module:      Phi-3's qkv_proj / gate_up_proj, GLM-4's gate_up_proj: one A for every
                               slice, B's rows split at the slices' edges (Phi-3 and GLM-4 fuse in the
                               same order, q|k|v and gate|up, with the same sizes; load_adapter splits)
    a module of its own:       Apertus' ungated up_proj (its MLP has no gate: mlp.up_proj).
FAMILY_TARGETS names what each family's checkpoints call their projections; a family not in it has no
LoRA. The MoE families adapt attention only (and Qwen3-MoE's dense layers' MLPs): experts and routers
are no linear layers of ours (stacked or quantized expert weights), so adapters on them are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from overnight.config import ModelArch


@dataclass(frozen=True)
class Projection:
    """Where a checkpoint projection lives in our model: module (under model.layers.N) and the output
    slices of that module's LoRA it covers (one, or all of a fused module's)."""

    module: str
    slices: tuple[int, ...]
    kind: str  # "attention" | "mlp"

    def dims(self, arch: ModelArch, name: str) -> tuple[int, int]:
        return projection_dims(arch, name)


def projection_dims(arch: ModelArch, name: str) -> tuple[int, int]:
    """(in, out) of the checkpoint projection `name`: the shapes its lora_A / lora_B must have."""
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "qkv_proj": (h, q + 2 * kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "gate_up_proj": (h, 2 * inter),
        "down_proj": (inter, h),
    }[name]


# Output slices of each module we wrap, in the fused layout (their sizes: slice_sizes).
MODULE_SLICES: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.up_proj": ("up_proj",),  # an ungated MLP (Apertus)
    "mlp.down_proj": ("down_proj",),
}

_ATTENTION: dict[str, Projection] = {
    "q_proj": Projection("self_attn.qkv_proj", (0,), "attention"),
    "k_proj": Projection("self_attn.qkv_proj", (1,), "attention"),
    "v_proj": Projection("self_attn.qkv_proj", (2,), "attention"),
    "o_proj": Projection("self_attn.o_proj", (0,), "attention"),
}
_DOWN = {"down_proj": Projection("mlp.down_proj", (0,), "mlp")}
_GATED_MLP = {
    "gate_proj": Projection("mlp.gate_up_proj", (0,), "mlp"),
    "up_proj": Projection("mlp.gate_up_proj", (1,), "mlp"),
    **_DOWN,
}
_FUSED_GATE_UP = {"gate_up_proj": Projection("mlp.gate_up_proj", (0, 1), "mlp"), **_DOWN}
# The projections of models/llama.py's dense decoder layer, as most checkpoints name them.
PROJECTIONS: dict[str, Projection] = {**_ATTENTION, **_GATED_MLP}
# Families whose checkpoints name them so (mistral3: an image checkpoint's language model, whose
# adapter keys carry a language_model. prefix; Gemma 3's image checkpoints are "gemma3" too).
_STANDARD_FAMILIES = (
    "llama", "qwen2", "qwen3", "mistral", "ministral3", "mistral3", "olmo2", "olmo3", "granite", "smollm3",
    "seed_oss", "exaone4", "gemma2", "gemma3", "cohere", "cohere2",
)  # fmt: skip

FAMILY_TARGETS: dict[str, dict[str, Projection]] = {
    **dict.fromkeys(_STANDARD_FAMILIES, PROJECTIONS),
    # Dense layers' MLPs adaptable, sparse layers' not (check_adapter asks arch.is_moe_layer).
    "qwen3_moe": PROJECTIONS,
    # Attention only: every layer sparse, or the dense layers' MLPs left out as well (shared experts,
    # a dense first layer: adapters for these families train attention, and a refusal names the rest).
    **dict.fromkeys(("mixtral", "gpt_oss", "qwen2_moe", "olmoe", "glm4_moe", "ernie4_5_moe"), _ATTENTION),
    "phi3": {
        "qkv_proj": Projection("self_attn.qkv_proj", (0, 1, 2), "attention"),
        "o_proj": _ATTENTION["o_proj"],
        **_FUSED_GATE_UP,
    },
    "glm4": {**_ATTENTION, **_FUSED_GATE_UP},
    "apertus": {**_ATTENTION, "up_proj": Projection("mlp.up_proj", (0,), "mlp"), **_DOWN},
}
SUPPORTED_ARCHITECTURES = tuple(FAMILY_TARGETS)


def family_targets(arch: ModelArch) -> dict[str, Projection]:
    """The projections adapters may target on `arch`'s family (empty: LoRA unsupported)."""
    return FAMILY_TARGETS.get(arch.architecture, {})


def slice_sizes(arch: ModelArch, module: str) -> list[int]:
    """Output rows of each of `module`'s slices (MODULE_SLICES order)."""
    return [projection_dims(arch, name)[1] for name in MODULE_SLICES[module]]
