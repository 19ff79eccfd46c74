"""Which linear layers hold FP8 weights, in what layout, and where the weights come from.

A QuantScheme is resolved once, with the model source (loader/resolve.py): from the checkpoint's own
config.json `quantization_config`, or, for a float checkpoint (or dummy weights) with
quantization="fp8", quantized online at load. Every nn.Linear but the LM head becomes an Fp8Linear
(quant/linear.py); activations are always quantized per token, dynamically.

Checkpoint formats understood (weights e4m3, scales float32, dequantized as weight * scale):

    quant_method "fp8", weight_block_size [bn, bk]   weight + weight_scale_inv [ceil(N/bn), ceil(K/bk)]
                                                      (the Qwen3-*-FP8 layout)
    quant_method "fp8", no weight_block_size          weight + weight_scale, one per tensor
    quant_method "compressed-tensors",                weight + weight_scale per tensor ([] or [1]),
      format "float-quantized"                        per channel ([N, 1]) or per block
                                                      (strategy "block", block_structure [bn, bk])
    quant_method "fbgemm_fp8"                         weight + weight_scale [N, 1] per channel; Llama 4's
      (Meta's Llama-3.1-405B-Instruct-FP8,            fused experts gate_up_proj [E, H, 2I] with
      Llama-4-Maverick-*-FP8)                         gate_up_proj_scale [E, 1, 2I], down_proj [E, I, H]
                                                      with down_proj_scale [E, H, 1] (quant/checkpoint.py)

fbgemm_fp8's modules_to_not_convert follows transformers' rule: an entry names a module, a dotted suffix
of one, or a parent of it (a regular expression matched at the start of the name, then "."); its
activation_scale_ub (1200 in Meta's releases) is read, checked and not applied. fbgemm (and vLLM, which
passes it to its per-token quantization) clamps each token's amax to it before scaling, so values beyond
+-ub saturate at ub; our per-token scale always covers the token's whole range (our fused norm,
SiLU-and-mul and quantize kernels have no input for a bound yet). The two give the same e4m3 values and
scales for every token whose largest |activation| entering an FP8 linear is at most the bound, which
normalized hidden states and typical SiLU-gated products are by far; a token beyond it (an outlier of
the few layers that build massive activations) keeps its large values here where fbgemm clips them. Llama 4's experts run as every FP8 checkpoint's
experts do here: weight-only FP8 (fbgemm quantizes their inputs too).

input_scale tensors (static activation scales) are accepted and checked but not used: the kernel that
produces each activation holds the whole row, so a per-token scale costs nothing, and it is never
coarser than one calibrated scale for all tokens.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from overnight.errors import ConfigError, ModelLoadError
from overnight.options import QUANTIZATIONS
from overnight.quant.int_scheme import IntScheme, int_scheme_from_hf_config, is_int_config, refuse_transforms
from overnight.quant.names import module_matches

# Block-scaled checkpoints: True keeps the blocks and runs the Triton block-scaled GEMM; False
# requantizes each weight per output channel at load and runs the per-channel path (torch._scaled_mm
# on CUDA, fused activation quantization everywhere). bench/fp8_weights_gpu.py measures both.
KEEP_WEIGHT_BLOCKS = False


@dataclass(frozen=True)
class QuantScheme:
    prequantized: bool = False  # the checkpoint holds FP8 weights; False: quantize float weights at load
    weight_block: tuple[int, int] | None = None  # checkpoint's [rows, columns] per weight scale
    scale_name: str = "weight_scale"  # the checkpoint's scale tensor beside each weight
    input_scales: bool = False  # the checkpoint ships static input_scale tensors (accepted, unused)
    ignore: tuple[str, ...] = ()  # checkpoint module names, or "re:" patterns, left unquantized
    keep_blocks: bool = KEEP_WEIGHT_BLOCKS
    method: str = "fp8"  # "fbgemm_fp8" for Meta's releases; "fp8" for every other FP8 source
    activation_scale_ub: float | None = None  # fbgemm_fp8's bound: read and not applied (docstring)

    @property
    def name(self) -> str:
        return "fp8"

    @property
    def fp8_linear(self) -> bool:
        return True

    @property
    def weight_bits(self) -> int:
        return 8

    @property
    def block_k(self) -> int | None:
        """Columns per weight scale in the model's layout; None: one scale per output channel."""
        return self.weight_block[1] if self.weight_block is not None and self.keep_blocks else None

    def ignores(self, *names: str) -> bool:
        """Whether the checkpoint leaves a module (e.g. model.layers.0.mlp.down_proj) unquantized;
        names: its names in the checkpoint layouts of its model (quant/apply.ignored)."""
        # Qwen3.5's image checkpoints name their text layers model.language_model.*, which the model
        # (and its text-only checkpoints) calls model.*: an ignore list may use either.
        texts = tuple(
            "model.language_model." + n.removeprefix("model.") for n in names if n.startswith("model.")
        )
        return any(module_matches(n, self.ignore) for n in (*names, *texts))

    def describe(self) -> str:
        if not self.prequantized:
            weights = "quantized at load, one scale per output channel"
        elif self.weight_block is None:
            if self.method == "fbgemm_fp8":
                weights = "fbgemm_fp8 checkpoint (weight_scale per channel)"
            else:
                weights = f"FP8 checkpoint ({self.scale_name} per tensor or channel)"
        else:
            bn, bk = self.weight_block
            layout = f"kept as {bk}-column blocks" if self.keep_blocks else "requantized per output channel"
            weights = f"FP8 checkpoint with {bn}x{bk} blocks, {layout}"
        return f"fp8 e4m3 weights ({weights}), activations quantized per token"


def resolve_quantization(
    option: str | None, checkpoint: QuantScheme | IntScheme | None
) -> QuantScheme | IntScheme | None:
    """The scheme a model runs with: the checkpoint's own when it has one (quantization="fp8" on an
    FP8 checkpoint is then fine), else online FP8 when asked, else None (weights in the compute dtype)."""
    if option is not None and option not in QUANTIZATIONS:
        raise ConfigError(f"unknown quantization {option!r}; supported: {', '.join(QUANTIZATIONS)} (or none)")
    if isinstance(checkpoint, IntScheme) and option == "fp8":
        raise ConfigError(
            f"quantization='fp8' asks for FP8 weights, but the checkpoint holds {checkpoint.describe()}; "
            "drop the option to run it as it is"
        )
    if checkpoint is not None:
        return checkpoint
    return QuantScheme() if option == "fp8" else None


def check_fp8_device(device: torch.device | str, scheme: QuantScheme) -> None:
    """Refuse a CUDA GPU without FP8 tensor cores (compute capability below 8.9) with what to do."""
    instead = (
        "use the model's bf16 checkpoint"
        if scheme.prequantized
        else "drop --quantization fp8 (quantization=None) to run bf16 weights"
    )
    require_fp8_device(device, "FP8 weights", instead)


def require_fp8_device(device: torch.device | str, what: str, instead: str) -> None:
    """ConfigError on a CUDA GPU of compute capability below 8.9 (no FP8 conversions in hardware: Ada,
    Hopper and Blackwell have them): `what` needs one, `instead` says what to do. The CPU passes: it
    runs the reference path, which dequantizes e4m3 weights to the compute dtype."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (8, 9):
        return
    name = torch.cuda.get_device_name(device)
    raise ConfigError(
        f"{what} need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
        f"{name} is {major}.{minor}. Either {instead}, or run on an FP8-capable GPU."
    )


# -- config.json's quantization_config ----------------------------------------------------------------


def scheme_from_hf_config(qc: dict[str, Any], where: str = "config.json") -> QuantScheme | IntScheme:
    """Read a `quantization_config`; raises ModelLoadError for methods and variants not implemented."""
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{where}: quantization_config must be an object, got {type(qc).__name__}")
    if is_int_config(qc):
        return int_scheme_from_hf_config(qc, where)
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_method(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method == "fbgemm_fp8":
        return _fbgemm_fp8(qc, where)
    raise ModelLoadError(
        f"{where}: quantization method {method!r} is not supported; supported: fp8 (quant_method "
        f"'fp8', e.g. the Qwen3-*-FP8 checkpoints), fbgemm_fp8 (Meta's FP8 Llama 3.1 / Llama 4 "
        f"releases), compressed-tensors (float-quantized FP8, pack-quantized W4A16/W8A16, "
        f"int-quantized W8A8), awq (GEMM) and gptq"
    )


def _fp8_method(qc: dict[str, Any], where: str) -> QuantScheme:
    if qc.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):  # MiniMax-M2 writes the torch dtype's name
        raise ModelLoadError(f"{where}: FP8 format {qc['fmt']!r} is not supported (only e4m3)")
    activations = qc.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise ModelLoadError(f"{where}: activation_scheme {activations!r} is not supported (dynamic, static)")
    block = qc.get("weight_block_size")
    ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    return QuantScheme(
        prequantized=True,
        weight_block=_block(block, where) if block is not None else None,
        scale_name="weight_scale_inv" if block is not None else "weight_scale",
        input_scales=activations == "static",
        ignore=tuple(ignore),
    )


def _fbgemm_fp8(qc: dict[str, Any], where: str) -> QuantScheme:
    """Meta's FP8 releases: per-channel e4m3 weights, per-token dynamic activations."""
    unknown = sorted(set(qc) - {"quant_method", "activation_scale_ub", "modules_to_not_convert"})
    if unknown:
        raise ModelLoadError(f"{where}: fbgemm_fp8 quantization_config has unknown keys {unknown}")
    ub = qc.get("activation_scale_ub", 1200.0)  # transformers' default
    if isinstance(ub, bool) or not isinstance(ub, (int, float)) or not math.isfinite(ub) or ub <= 0:
        raise ModelLoadError(
            f"{where}: fbgemm_fp8 activation_scale_ub must be a positive finite number, got {ub!r}"
        )
    entries = qc.get("modules_to_not_convert") or []
    if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
        raise ModelLoadError(
            f"{where}: fbgemm_fp8 modules_to_not_convert must be a list of module names, got {entries!r}"
        )
    return QuantScheme(
        prequantized=True,
        scale_name="weight_scale",
        ignore=tuple(p for e in entries for p in _parent_or_suffix(e, where)),
        method="fbgemm_fp8",
        activation_scale_ub=float(ub),
    )


def _parent_or_suffix(entry: str, where: str) -> tuple[str, str]:
    """transformers' modules_to_not_convert rule in our pattern language: the name or a dotted suffix of
    it (module_matches), or the entry as a regular expression matching the start of the name up to a
    "." or its end (a parent: "model.layers.0" keeps every linear of layer 0)."""
    try:
        re.compile(entry)
    except re.error as e:
        raise ModelLoadError(
            f"{where}: fbgemm_fp8 modules_to_not_convert entry {entry!r} is not a valid pattern: {e}"
        ) from None
    return entry, f"re:(?:{entry})(?:\\.|$)"


def _compressed_tensors(qc: dict[str, Any], where: str) -> QuantScheme:
    refuse_transforms(qc, where)
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ModelLoadError(f"{where}: compressed-tensors quantization_config has no config_groups")
    strategies, blocks, static = set(), set(), set()
    for name, group in groups.items():
        fmt = group.get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise ModelLoadError(
                f"{where}: compressed-tensors format {fmt!r} (group {name}) is not supported; supported: "
                "float-quantized (FP8), pack-quantized (W4A16, W8A16), int-quantized (W8A8)"
            )
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8 or not w.get("symmetric", True):
            raise ModelLoadError(f"{where}: group {name} weights are not symmetric 8-bit float: {w}")
        strategy = w.get("strategy", "tensor")
        if strategy not in ("tensor", "channel", "block"):
            raise ModelLoadError(
                f"{where}: weight strategy {strategy!r} (group {name}) is not supported (tensor, channel, block)"
            )
        strategies.add(strategy)
        if strategy == "block":
            blocks.add(_block(w.get("block_structure"), where))
        acts = group.get("input_activations")
        if acts is not None and (acts.get("type") != "float" or acts.get("num_bits") != 8):
            raise ModelLoadError(f"{where}: group {name} input activations are not 8-bit float: {acts}")
        static.add(acts is not None and not acts.get("dynamic", False))
    if len(blocks) > 1 or ("block" in strategies and len(strategies) > 1):
        raise ModelLoadError(f"{where}: config groups mix block-scaled and other weights; not supported")
    return QuantScheme(
        prequantized=True,
        weight_block=next(iter(blocks)) if blocks else None,
        scale_name="weight_scale",
        input_scales=True in static,
        ignore=tuple(qc.get("ignore") or ()),
    )


def _block(value: Any, where: str) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise ModelLoadError(f"{where}: weight block size must be two positive integers, got {value!r}")
    bn, bk = value
    if bk & (bk - 1) or bk < 32:  # 32: the K step of the GPU's FP8 MMA, which a block's K steps divide
        raise ModelLoadError(f"{where}: weight block of {bk} columns is not supported (a power of two >= 32)")
    return bn, bk
