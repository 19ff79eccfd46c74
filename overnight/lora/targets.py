"""Which checkpoint projections an adapter may target on each family, and where each lands in our model.

Our decoder layers fuse q/k/v into self_attn.qkv_proj and gate/up into mlp.gate_up_proj (MODULE_SLICES
lists each wrapped module's output slices, in its fused row order). A checkpoint projection is then
    a slice of one module:     q_proj -> qkv_proj slice 0, up_proj -> gate_up_proj slice 1, ...
    a whole fused module:      Phi-3's qkv_proj / gate_up_proj, GLM-4's gate_up_proj: one A for every
                               slice, B's rows split at the slices' edges (Phi-3 and GLM-4 fuse in the
                               same order, q|k|v and gate|up, with the same sizes; load_adapter splits)
    a module of its own:       Apertus' ungated up_proj (its MLP has no gate: mlp.up_proj); every
                               projection of the Qwen3.5 / Qwen3-Next hybrids (models/qwen3_next.py
                               keeps the checkpoint's linears: q/k/v/o_proj unfused, the Gated DeltaNet
                               layers' in_proj_* and out_proj with the checkpoint's row order); the
                               Mamba2 / short-conv in_proj and out_proj; Granite's shared_mlp.
FAMILY_TARGETS names what each family's checkpoints call their projections (Projection.checkpoint where
the checkpoint holds one elsewhere than we do: Llama 4's and LFM2's feed_forward); a family not in it
has no LoRA. The MoE families adapt attention only (and their dense layers' MLPs where the table lists
them): experts and routers are no linear layers of ours (stacked or quantized expert weights), so
adapters on them are refused.

Which layers hold a projection, and where, depends on the layer (locate): a hybrid's layer holds either
attention or a linear mixer, a sparse layer no dense MLP (unless beside its experts: Gemma 4, Granite),
a Gemma 4 KV-shared layer only q_proj (a module of its own), a K=V layer no v_proj, and Nemotron-H's
model.layers are its blocks, one mixer each. An adapter's tensor for a layer without it was trained for
another model. module_dims gives each module's input and slice sizes per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from overnight.arch import ModelArch


@dataclass(frozen=True)
class Projection:
    """Where a checkpoint projection lives in our model: module (under model.layers.N) and the output
    slices of that module's LoRA it covers (one, or all of a fused module's)."""

    module: str
    slices: tuple[int, ...]
    # "attention" | "mlp" (none in a sparse layer) | "mixer" (a hybrid's linear-attention, Mamba2 or
    # short-conv layers) | "dense_mlp" (an MLP in every layer, beside any experts: Granite's shared_mlp)
    # | "shared_expert" (a sparse layer's shared expert, beside its routed ones)
    kind: str
    # Where the checkpoint holds it inside a layer when not where we do ("feed_forward.gate_proj" of
    # Llama 4, whose MLP we call mlp); "": module's parent and the projection's name.
    checkpoint: str = ""

    def path(self, name: str) -> str:
        """The projection's path inside a checkpoint's layer (an adapter's key between layers.N. and .lora_)."""
        return self.checkpoint or f"{self.module.partition('.')[0]}.{name}"

    def in_layer(self, arch: ModelArch, layer: int) -> bool:
        """Whether layer `layer` of `arch` has this kind of projection (locate() says where)."""
        if arch.block_pattern:  # Nemotron-H: block `layer` is one mixer of its pattern's kind
            return _BLOCK_KINDS[arch.block_pattern[layer]] == self.kind
        if self.kind == "mlp":  # Gemma 4's MoE layers run their experts beside a dense MLP
            return arch.moe_beside_dense or not arch.is_moe_layer(layer)
        if self.kind == "mixer":
            return arch.is_linear_layer(layer)
        if self.kind == "dense_mlp":
            return True
        if self.kind == "shared_expert":
            return arch.is_moe_layer(layer)
        return not arch.is_linear_layer(layer)


# Nemotron-H: model.layers.N is block N of block_pattern, a single mixer; only its Mamba2 and attention
# blocks are ModelArch layers (the KV / state caches' index), its MLP and MoE blocks sit between them.
_BLOCK_KINDS = {"M": "mixer", "*": "attention", "-": "mlp", "E": "moe"}
# Nemotron-H's blocks' modules, and the module of the other families each is shaped as
_BLOCK_MODULES = {
    "mixer.qkv_proj": "self_attn.qkv_proj",
    "mixer.o_proj": "self_attn.o_proj",
    "mixer.in_proj": "mamba.in_proj",
    "mixer.out_proj": "mamba.out_proj",
    "mixer.up_proj": "mlp.up_proj",
    "mixer.down_proj": "mlp.down_proj",
}


def num_layers(arch: ModelArch) -> int:
    """How many model.layers an adapter's keys may index: Nemotron-H's blocks, else the layers."""
    return len(arch.block_pattern) or arch.num_hidden_layers


def arch_layer(arch: ModelArch, layer: int) -> int:
    """The ModelArch layer of model.layers[layer]: itself, or Nemotron-H's Mamba2 / attention blocks
    before block `layer` counted (per-layer shapes read it only for those blocks)."""
    if not arch.block_pattern:
        return layer
    return sum(c in "M*" for c in arch.block_pattern[:layer])


def is_sparse(arch: ModelArch, layer: int) -> bool:
    """Whether model.layers[layer] has a mixture of experts in place of a dense MLP."""
    if arch.block_pattern:
        return arch.block_pattern[layer] == "E"
    return arch.is_moe_layer(layer) and not arch.moe_beside_dense


# Qwen3.5 / Qwen3-Next's full attention has an output gate: q_proj's rows are [q | gate] per head, twice
# the query's size, and an adapter's lora_B follows those rows.
GATED_QUERY_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def module_dims(arch: ModelArch, module: str, layer: int = 0) -> tuple[int, list[int]]:
    """(input features, output rows of each slice) of our `module` in layer `layer` (Gemma 4's
    full-attention layers have their own head size and KV heads, its KV-shared layers may have a
    double-wide MLP): the shapes an adapter's lora_A / lora_B must have."""
    if module in _BLOCK_MODULES:
        return module_dims(arch, _BLOCK_MODULES[module], arch_layer(arch, layer))
    h = arch.hidden_size
    parent, _, leaf = module.partition(".")
    if parent == "linear_attn":  # Gated DeltaNet (models/gated_deltanet.py)
        key = arch.linear_num_key_heads * arch.linear_key_head_dim
        value = arch.linear_num_value_heads * arch.linear_value_head_dim
        heads = arch.linear_num_value_heads
        if leaf == "out_proj":
            return value, [h]
        out = {
            "in_proj_qkv": 2 * key + value,
            "in_proj_z": value,
            "in_proj_b": heads,
            "in_proj_a": heads,
            "in_proj_qkvz": 2 * key + 2 * value,  # Qwen3-Next: rows grouped by key head
            "in_proj_ba": 2 * heads,
        }[leaf]
        return h, [out]
    if parent == "mamba":  # Mamba2 (models/mamba2_mixer.py): in_proj gives z | x|B|C | dt
        inner = arch.mamba_intermediate
        conv = inner + 2 * arch.mamba_n_groups * arch.mamba_d_state
        return (h, [inner + conv + arch.mamba_n_heads]) if leaf == "in_proj" else (inner, [h])
    if parent == "conv":  # LFM2's short conv: in_proj gives B | C | x
        return h, [3 * h if leaf == "in_proj" else h]
    if module.startswith("mlp.shared_expert."):  # a gated MLP of its own width (models/qwen3_next.py)
        inter = arch.shared_expert_intermediate_size
        return (inter, [h]) if leaf == "shared_expert.down_proj" else (h, [inter])
    if parent == "shared_mlp":  # Granite's: input_linear gives gate | up
        inter = arch.shared_expert_intermediate_size if arch.num_experts else arch.intermediate_size
        return (h, [2 * inter]) if leaf == "input_linear" else (inter, [h])
    d = arch.layer_head_dim(layer)
    q, kv = arch.num_attention_heads * d, arch.layer_num_kv_heads(layer) * d
    inter = arch.layer_intermediate_size(layer)
    rows = {
        "q_proj": 2 * q if arch.architecture in GATED_QUERY_FAMILIES else q,
        "k_proj": kv,
        "v_proj": kv,
        "o_proj": h,
        "gate_proj": inter,
        "up_proj": inter,
        "down_proj": h,
    }
    d_in = {"self_attn.o_proj": q, "mlp.down_proj": inter}.get(module, h)
    return d_in, [rows[name] for name in layer_slices(arch, layer, module)]


# Output slices of each module we wrap, in the fused layout (their sizes: slice_sizes).
MODULE_SLICES: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.up_proj": ("up_proj",),  # an ungated MLP (Apertus)
    "mlp.down_proj": ("down_proj",),
    # the hybrids' unfused attention and Gated DeltaNet projections, each a module of its own
    **{f"self_attn.{name}": (name,) for name in ("q_proj", "k_proj", "v_proj")},
    **{
        f"linear_attn.{name}": (name,)
        for name in (
            "in_proj_qkv",
            "in_proj_z",
            "in_proj_b",
            "in_proj_a",
            "in_proj_qkvz",
            "in_proj_ba",
            "out_proj",
        )
    },
    # Mamba2 (Granite 4.0-H) and LFM2's short conv: in_proj / out_proj as the checkpoints hold them
    **{f"{mixer}.{name}": (name,) for mixer in ("mamba", "conv") for name in ("in_proj", "out_proj")},
    "shared_mlp.input_linear": ("input_linear",),  # Granite's fused gate | up, one projection
    "shared_mlp.output_linear": ("output_linear",),
    # a sparse layer's shared expert (SplitMLP: unfused, its checkpoint's names)
    **{
        f"mlp.shared_expert.{name}": (f"shared_expert.{name}",)
        for name in ("gate_proj", "up_proj", "down_proj")
    },
}
MODULE_SLICES.update({block: MODULE_SLICES[like] for block, like in _BLOCK_MODULES.items()})

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
_UNFUSED_ATTENTION = {
    name: Projection(f"self_attn.{name}", (0,), "attention")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj")
}


def _mixer(*names: str) -> dict[str, Projection]:
    return {name: Projection(f"linear_attn.{name}", (0,), "mixer") for name in names}


# Qwen3.5 (dense and MoE) and Qwen3-Next: attention, the Gated DeltaNet projections (four of them, or
# Qwen3-Next's fused two) and the MLP of dense layers; a MoE layer's experts, router and shared expert
# are refused as on the other MoE families.
# A sparse layer's shared expert: keyed shared_expert.gate_proj etc. (its leaves are the dense MLP's).
_SHARED_EXPERT = {
    f"shared_expert.{name}": Projection(
        f"mlp.shared_expert.{name}", (0,), "shared_expert", f"mlp.shared_expert.{name}"
    )
    for name in ("gate_proj", "up_proj", "down_proj")
}
_QWEN3_5 = {
    **_UNFUSED_ATTENTION,
    **_mixer("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    **_GATED_MLP,
    **_SHARED_EXPERT,
}
_QWEN3_NEXT = {
    **_UNFUSED_ATTENTION,
    **_mixer("in_proj_qkvz", "in_proj_ba", "out_proj"),
    **_GATED_MLP,
    **_SHARED_EXPERT,
}
# Llama 4: the MLP is feed_forward in the checkpoint: a dense layer's MLP and a MoE layer's shared
# expert adaptable, its routed experts and router not.
_LLAMA4 = {
    **_ATTENTION,
    **{name: replace(where, checkpoint=f"feed_forward.{name}") for name, where in _GATED_MLP.items()},
    **{name: replace(where, checkpoint=f"feed_forward.{name}") for name, where in _SHARED_EXPERT.items()},
}
# Granite 4.0-H: attention (q/k/v fused here), the Mamba2 layers' in_proj / out_proj and the shared MLP
# beside the routed experts (input_linear holds gate | up as our module does).
_GRANITE_HYBRID = {
    **_ATTENTION,
    "in_proj": Projection("mamba.in_proj", (0,), "mixer"),
    "out_proj": Projection("mamba.out_proj", (0,), "mixer"),
    "input_linear": Projection("shared_mlp.input_linear", (0,), "dense_mlp"),
    "output_linear": Projection("shared_mlp.output_linear", (0,), "dense_mlp"),
}
# LFM2: the checkpoint's attention out_proj and feed_forward w1 / w3 / w2 are our o_proj and gate / up /
# down (models/lfm2.py renames them); its short conv's in_proj / out_proj. Keys name the parent where a
# leaf would be ambiguous (two out_proj).
_LFM2 = {
    **{name: _ATTENTION[name] for name in ("q_proj", "k_proj", "v_proj")},
    "self_attn.out_proj": replace(_ATTENTION["o_proj"], checkpoint="self_attn.out_proj"),
    "w1": replace(_GATED_MLP["gate_proj"], checkpoint="feed_forward.w1"),
    "w3": replace(_GATED_MLP["up_proj"], checkpoint="feed_forward.w3"),
    "w2": replace(_GATED_MLP["down_proj"], checkpoint="feed_forward.w2"),
    "conv.in_proj": Projection("conv.in_proj", (0,), "mixer", checkpoint="conv.in_proj"),
    "conv.out_proj": Projection("conv.out_proj", (0,), "mixer", checkpoint="conv.out_proj"),
}
# Nemotron-H: each block's mixer (attention, Mamba2 or the ungated MLP) under mixer.*, as our blocks hold
# them (q/k/v fused); the MoE blocks' experts, router and shared experts refused.
_NEMOTRON_H = {
    **{
        name: replace(where, module=f"mixer.{where.module.partition('.')[2]}")
        for name, where in _ATTENTION.items()
    },
    "in_proj": Projection("mixer.in_proj", (0,), "mixer"),
    "out_proj": Projection("mixer.out_proj", (0,), "mixer"),
    "up_proj": Projection("mixer.up_proj", (0,), "mlp"),
    "down_proj": Projection("mixer.down_proj", (0,), "mlp"),
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
    "qwen3_5": _QWEN3_5,
    "qwen3_5_moe": _QWEN3_5,
    "qwen3_next": _QWEN3_NEXT,
    # Per layer (locate): KV-shared layers hold q_proj alone, K=V full layers no v_proj; the dense MLP
    # beside a MoE layer's experts is adaptable. The per-layer-input gate / projection are not.
    "gemma4": PROJECTIONS,
    "llama4": _LLAMA4,
    "granitemoehybrid": _GRANITE_HYBRID,
    "lfm2": _LFM2,
    "lfm2_moe": _LFM2,  # the first num_dense_layers' MLPs; the experts refused
    "nemotron_h": _NEMOTRON_H,
}
SUPPORTED_ARCHITECTURES = tuple(FAMILY_TARGETS)
# Families whose adapters run on one device only: their projections are sharded under tensor
# parallelism by rules (parallel/tp_hybrid.py, Gemma 4's per-layer shapes) that LoRASharding does not
# follow yet.
SINGLE_DEVICE_FAMILIES = (
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "gemma4",
    "granitemoehybrid",
    "lfm2",
    "lfm2_moe",
)


def family_targets(arch: ModelArch) -> dict[str, Projection]:
    """The projections adapters may target on `arch`'s family (empty: LoRA unsupported)."""
    return FAMILY_TARGETS.get(arch.architecture, {})


def layer_slices(arch: ModelArch, layer: int, module: str) -> tuple[str, ...]:
    """The output slices of `module` in layer `layer`: MODULE_SLICES's, but a Gemma 4 full-attention
    layer with attention_k_eq_v has no v_proj (its values are its keys) and fuses q | k alone."""
    names = MODULE_SLICES[module]
    if module == "self_attn.qkv_proj" and arch.attention_k_eq_v and arch.layer_window(layer) is None:
        return names[:2]
    return names


def locate(arch: ModelArch, name: str, layer: int) -> tuple[str, tuple[int, ...]] | None:
    """(module, its output slices) that the checkpoint projection `name` of layer `layer` lands in; None
    when that layer has no such projection (a hybrid's other kind of layer, a sparse layer's MLP,
    Gemma 4's KV-shared layers' k/v and K=V layers' v_proj)."""
    where = family_targets(arch)[name]
    if not where.in_layer(arch, layer):
        return None
    module = where.module
    if module == "self_attn.qkv_proj" and arch.kv_source_layer(layer) != layer:
        # A KV-shared layer (Gemma 4) projects q alone; its keys and values are an earlier layer's.
        return ("self_attn.q_proj", (0,)) if name == "q_proj" else None
    names = [MODULE_SLICES[module][s] for s in where.slices]
    here = layer_slices(arch, layer, module)
    if any(n not in here for n in names):
        return None
    return module, tuple(here.index(n) for n in names)


def layer_modules(arch: ModelArch, layer: int) -> dict[str, list[int]]:
    """The modules of layer `layer` that LoRA wraps on `arch` (those its family's targets land in) and
    their slices' output rows."""
    modules: dict[str, list[int]] = {}
    for name in family_targets(arch):
        found = locate(arch, name, layer)
        if found is not None and found[0] not in modules:
            modules[found[0]] = slice_sizes(arch, found[0], layer)
    return modules


def slice_sizes(arch: ModelArch, module: str, layer: int = 0) -> list[int]:
    """Output rows of each of `module`'s slices in layer `layer` (layer_slices order)."""
    return module_dims(arch, module, layer)[1]
