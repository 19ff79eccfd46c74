"""Integer-weight checkpoints: which published layout a `quantization_config` describes, read once.

Formats understood (K = in_features, N = out_features, G = group size; value = (q - z) * s):

    compressed-tensors "pack-quantized"   W4A16 / W8A16: weight_packed int32 [N, K*b/32], weight_scale
                                          [N, K/G] (group) or [N, 1] (channel), weight_zero_point packed
                                          along N when asymmetric, weight_shape, weight_g_idx [K] when
                                          actorder is "group"
    compressed-tensors "int-quantized"    W8A8: weight int8 [N, K] with weight_scale [N, 1]; activations
                                          int8 per token, dynamic
    AWQ (version "gemm")                  qweight int32 [K, N/8] (columns interleaved), qzeros [K/G, N/8],
                                          scales [K/G, N]
    GPTQ (4 or 8 bits)                    qweight int32 [K*b/32, N] packed along K, qzeros [K/G, N*b/32],
                                          scales [K/G, N], g_idx [K] (act-order when desc_act);
                                          checkpoint_format "gptq" (v1) stores z - 1, "gptq_v2" stores z

Layers left float: compressed-tensors' `ignore`, AWQ's and GPTQ's `modules_to_not_convert`, GPTQ's
`dynamic` "-:" skips and `modules_in_block_to_quantize` (an allowlist), matched against every name the
model's checkpoints give a module (quant/apply.ignored).

compressed-tensors configs are parsed by the compressed-tensors package itself (its pydantic models).
Bit layouts and dequantization live in quant/int_formats.py; the streaming conversion at load in
quant/int_checkpoint.py. Anything else (3-bit, AWQ's GEMV/exllama variants, static activation scales,
mixed schemes across config groups, a quantized LM head in GPTQ) is refused here, before any weight
is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from overnight.errors import ModelLoadError
from overnight.quant.names import module_matches

INT_METHODS = ("compressed-tensors", "awq", "gptq")


@dataclass(frozen=True)
class IntScheme:
    method: str  # "compressed-tensors" | "awq" | "gptq"
    bits: int  # 4 or 8
    group_size: int | None  # input columns per scale; None: one scale per output channel
    symmetric: bool  # zero point 2^(bits-1) everywhere (no zero tensor in the checkpoint)
    act_order: bool = False  # a g_idx tensor maps input columns to groups in any order
    int8_activations: bool = False  # W8A8: activations quantized per token, dynamically
    gptq_v1: bool = False  # GPTQ "gptq" checkpoint_format: qzeros hold z - 1
    ignore: tuple[str, ...] = ()  # checkpoint module names or "re:" patterns left unquantized
    # GPTQ's modules_in_block_to_quantize, flattened: when given, only modules one of these names
    # (or prefixes) occurs in are quantized (vLLM's rule: a substring of the module's name)
    quantized_only: tuple[str, ...] = ()
    # Not the checkpoint's: how this run holds it (the int_weights option, loader/int_form.py). True:
    # every quantized layer and expert is dequantized to the compute dtype at load on every device,
    # into plain nn.Linear layers and float experts (quant/apply.keeps_int_packed); False: packed on a
    # GPU. The CPU dequantizes either way. Weight-only schemes only: W8A8 keeps its int8 GEMM.
    dense: bool = False

    def __post_init__(self) -> None:
        if self.dense and self.int8_activations:
            raise ValueError("a W8A8 scheme keeps its int8 layers: dense applies to weight-only schemes")

    def ignores(self, *names: str) -> bool:
        """Whether the checkpoint leaves a module unquantized; names: the module's names in the
        checkpoint layouts its model has been saved in (quant/apply.ignored), any of which an entry
        may use."""
        if self.quantized_only and not any(entry in n for n in names for entry in self.quantized_only):
            return True
        if self.method == "awq":  # transformers' AWQ rule: a listed name anywhere in the module's
            return any(entry in n for n in names for entry in self.ignore)
        return any(module_matches(n, self.ignore) for n in names)

    @property
    def name(self) -> str:
        """The method as ModelConfig.quantization reports it: awq, gptq, compressed-tensors."""
        return self.method

    @property
    def fp8_linear(self) -> bool:
        return False

    @property
    def weight_bits(self) -> int:
        return self.bits

    def required_parts(self) -> frozenset[str]:
        """The checkpoint tensors (by suffix) each quantized module must ship."""
        if self.method == "compressed-tensors" and self.int8_activations:
            return frozenset({"weight", "weight_scale"})
        if self.method == "compressed-tensors":
            parts = {"weight_packed", "weight_scale", "weight_shape"}
            if not self.symmetric:
                parts.add("weight_zero_point")
            if self.act_order:
                parts.add("weight_g_idx")
            return frozenset(parts)
        parts = {"qweight", "qzeros", "scales"}
        if self.act_order:
            parts.add("g_idx")
        return frozenset(parts)

    def optional_parts(self) -> frozenset[str]:
        """Parts a module may ship beyond the required ones (checked, then dropped)."""
        if self.method == "gptq":
            return frozenset({"g_idx"})  # GPTQ writers store it even without act-order
        if self.method == "compressed-tensors" and not self.int8_activations:
            return frozenset({"weight_g_idx"})  # without actorder "group": checked to be in order
        return frozenset()

    def describe(self) -> str:
        if self.int8_activations:
            return "int8 weights per output channel and int8 activations per token (W8A8, compressed-tensors)"
        groups = f"groups of {self.group_size}" if self.group_size else "per output channel"
        zeros = "symmetric" if self.symmetric else "with zero points"
        order = ", act-order g_idx" if self.act_order else ""
        held = ", dequantized to the compute dtype at load" if self.dense else ""
        return f"{self.method} int{self.bits} weights ({groups}, {zeros}{order}){held}, 16-bit activations"


def int_scheme_from_hf_config(qc: dict[str, Any], where: str) -> IntScheme:
    method = qc.get("quant_method")
    if method == "awq":
        return _awq(qc, where)
    if method == "gptq":
        return _gptq(qc, where)
    return _compressed_tensors(qc, where)


def is_int_config(qc: dict[str, Any]) -> bool:
    """Whether a quantization_config names an integer-weight layout (else FP8 or unknown)."""
    method = qc.get("quant_method")
    if method in ("awq", "gptq"):
        return True
    if method != "compressed-tensors":
        return False
    formats = {g.get("format") for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)}
    formats.add(qc.get("format"))
    return bool(formats & {"pack-quantized", "int-quantized", "naive-quantized"})


def _bits(value: Any, allowed: tuple[int, ...], where: str, method: str) -> int:
    if value not in allowed:
        raise ModelLoadError(
            f"{where}: {method} with {value}-bit weights is not supported; supported: "
            + ", ".join(f"{b}-bit" for b in allowed)
        )
    return int(value)


def _group(value: Any, where: str, method: str) -> int | None:
    if value in (None, -1, 0):
        return None
    if not isinstance(value, int) or value < 0 or value % 8:
        raise ModelLoadError(
            f"{where}: {method} group_size {value!r} is not supported (-1 or a multiple of 8)"
        )
    return value


def _awq(qc: dict[str, Any], where: str) -> IntScheme:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(
            f"{where}: AWQ version {version!r} is not supported; only the GEMM layout ('gemm'), "
            "the one AutoAWQ and llm-compressor export"
        )
    if not qc.get("zero_point", True):
        raise ModelLoadError(f"{where}: AWQ without zero points (zero_point false) is not supported")
    bits = _bits(qc.get("bits", qc.get("w_bit")), (4,), where, "AWQ")
    group = _group(qc.get("group_size", qc.get("q_group_size")), where, "AWQ")
    return IntScheme(
        method="awq",
        bits=bits,
        group_size=group,
        symmetric=False,
        ignore=tuple(qc.get("modules_to_not_convert") or ()),
    )


def _gptq(qc: dict[str, Any], where: str) -> IntScheme:
    bits = _bits(qc.get("bits"), (4, 8), where, "GPTQ")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(
            f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2); "
            "Marlin/BitBLAS/QQQ exports are repacked layouts of their own"
        )
    if qc.get("lm_head"):
        raise ModelLoadError(f"{where}: GPTQ with a quantized LM head (lm_head: true) is not supported")
    pack_dtype = str(qc.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        raise ModelLoadError(f"{where}: GPTQ pack_dtype {pack_dtype!r} is not supported (int32)")
    group = _group(qc.get("group_size"), where, "GPTQ")
    skipped = _gptq_dynamic(qc.get("dynamic"), qc, where)
    blocks = qc.get("modules_in_block_to_quantize") or ()
    if not isinstance(blocks, (list, tuple)):
        raise ModelLoadError(f"{where}: GPTQ modules_in_block_to_quantize must be a list, got {blocks!r}")
    flat = [m for entry in blocks for m in (entry if isinstance(entry, (list, tuple)) else (entry,))]
    if not all(isinstance(m, str) for m in flat):
        raise ModelLoadError(f"{where}: GPTQ modules_in_block_to_quantize must name modules, got {blocks!r}")
    return IntScheme(
        method="gptq",
        bits=bits,
        group_size=group,
        symmetric=bool(qc.get("sym", True)),
        act_order=bool(qc.get("desc_act", False)),
        gptq_v1=fmt == "gptq",
        ignore=(*(qc.get("modules_to_not_convert") or ()), *skipped),
        quantized_only=tuple(flat),
    )


def _gptq_dynamic(dynamic: Any, qc: dict[str, Any], where: str) -> list[str]:
    """GPTQ's per-module overrides (GPTQModel's "dynamic": regular expressions re.match'ed against a
    module's name; "-:" skips the module, "+:" or none overrides fields of the scheme for it) -> the
    "re:" ignore entries of its skips. An override that changes the scheme for some modules (mixed
    precision) is refused: one scheme per checkpoint is supported."""
    if not dynamic:
        return []
    if not isinstance(dynamic, dict):
        raise ModelLoadError(f"{where}: GPTQ dynamic must map module patterns to overrides, got {dynamic!r}")
    base = {
        "bits": qc.get("bits"),
        "group_size": qc.get("group_size"),
        "desc_act": bool(qc.get("desc_act", False)),
        "sym": bool(qc.get("sym", True)),
    }
    skipped = []
    for pattern, override in dynamic.items():
        if pattern.startswith("-:"):
            skipped.append("re:" + pattern.removeprefix("-:"))
            continue
        if not isinstance(override, dict):
            raise ModelLoadError(
                f"{where}: GPTQ dynamic override {pattern!r} must be an object, got {override!r}"
            )
        changed = {k: v for k, v in override.items() if k in base and v != base[k]}
        if changed:
            raise ModelLoadError(
                f"{where}: GPTQ dynamic override {pattern!r} sets {changed} for some modules (mixed "
                "schemes in one checkpoint); not supported"
            )
    return skipped


def refuse_transforms(qc: dict[str, Any], where: str) -> None:
    """compressed-tensors checkpoints whose weights need more than dequantization: rotations (SpinQuant /
    QuIP transforms, applied online at run time) or 2:4 sparse storage."""
    if qc.get("transform_config"):
        raise ModelLoadError(
            f"{where}: compressed-tensors transform_config (rotated weights, e.g. SpinQuant/QuIP) is not "
            "supported: the online transforms are not implemented"
        )
    sparsity = qc.get("sparsity_config") or {}
    if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
        raise ModelLoadError(
            f"{where}: compressed-tensors sparsity format {sparsity.get('format')!r} is not supported (dense only)"
        )


def _compressed_tensors(qc: dict[str, Any], where: str) -> IntScheme:
    from compressed_tensors.quantization import QuantizationConfig  # the package's own config model

    refuse_transforms(qc, where)
    # actorder "group" (weight_g_idx tensors, llm-compressor before 0.10) left the package's enum; it
    # is read here and the rest validated by the package.
    qc, group_order = _strip_group_actorder(qc)
    try:
        config = QuantizationConfig.model_validate(qc)
    except Exception as e:  # pydantic's ValidationError and the package's own ValueErrors
        raise ModelLoadError(f"{where}: compressed-tensors quantization_config is malformed: {e}") from None
    if config.kv_cache_scheme is not None:
        raise ModelLoadError(f"{where}: compressed-tensors kv_cache_scheme is not supported with int weights")
    if not config.config_groups:
        raise ModelLoadError(f"{where}: compressed-tensors quantization_config has no config_groups")
    schemes = set()
    for name, group in config.config_groups.items():
        fmt = getattr(group, "format", None) or config.format
        schemes.add(_ct_group(name, fmt, group, name in group_order, where))
    if len(schemes) > 1:
        raise ModelLoadError(
            f"{where}: compressed-tensors config groups mix different int schemes; not supported"
        )
    bits, group_size, symmetric, act_order, w8a8 = schemes.pop()
    return IntScheme(
        method="compressed-tensors",
        bits=bits,
        group_size=group_size,
        symmetric=symmetric,
        act_order=act_order,
        int8_activations=w8a8,
        ignore=tuple(config.ignore or ()),
    )


def _strip_group_actorder(qc: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """qc without actorder "group" (or the older True) in its weights, and the groups that had it."""
    groups = dict(qc.get("config_groups") or {})
    ordered = set()
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and weights.get("actorder") in ("group", True):
            ordered.add(name)
            groups[name] = {**group, "weights": {**weights, "actorder": None}}
    return ({**qc, "config_groups": groups} if ordered else qc), ordered


def _ct_group(
    name: str, fmt: Any, group: Any, group_order: bool, where: str
) -> tuple[int, int | None, bool, bool, bool]:
    w = group.weights
    label = f"{where}: compressed-tensors group {name}"
    if fmt not in ("pack-quantized", "int-quantized"):
        raise ModelLoadError(
            f"{label}: format {fmt!r} is not supported; supported int formats: pack-quantized (W4A16, "
            "W8A16), int-quantized (W8A8)"
        )
    if w is None or str(w.type) != "int":
        raise ModelLoadError(f"{label}: weights must be integers, got {w}")
    strategy = str(w.strategy)
    acts = group.input_activations
    if fmt == "int-quantized":
        if w.num_bits != 8 or not w.symmetric or strategy != "channel":
            raise ModelLoadError(
                f"{label}: int-quantized weights must be symmetric 8-bit per channel, got {w}"
            )
        if acts is None or str(acts.type) != "int" or acts.num_bits != 8 or not acts.symmetric:
            raise ModelLoadError(f"{label}: int-quantized needs symmetric 8-bit int activations, got {acts}")
        if acts.dynamic is not True or str(acts.strategy) != "token":
            raise ModelLoadError(
                f"{label}: only dynamic per-token int8 activations are supported (got strategy "
                f"{acts.strategy}, dynamic {acts.dynamic}); static activation scales are not"
            )
        return 8, None, True, False, True
    if acts is not None:
        raise ModelLoadError(f"{label}: pack-quantized with quantized activations is not supported: {acts}")
    bits = _bits(w.num_bits, (4, 8), label, "pack-quantized")
    if strategy == "group":
        group_size = _group(w.group_size, label, "pack-quantized")
    elif strategy == "channel":
        group_size = None
    else:
        raise ModelLoadError(f"{label}: weight strategy {strategy!r} is not supported (group, channel)")
    # actorder "weight"/"static" was undone when the checkpoint was written (groups stay contiguous);
    # "group" ships weight_g_idx, mapping each input column to its group.
    if group_order and group_size is None:
        raise ModelLoadError(f"{label}: actorder 'group' needs the group strategy")
    return bits, group_size, bool(w.symmetric), group_order, False
