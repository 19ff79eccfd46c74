"""GGUF checkpoints: the architecture, stop ids and chat template from the metadata, and the weights as
HF-named float32 tensors (gpt-oss's MXFP4 experts as the published checkpoints' uint8 blocks and
scales). The families read through their config.json reader are in gguf_families.py / gguf_tensors.py.

The header is parsed here with `struct` rather than `gguf.GGUFReader`: the reader builds a numpy view per
array element, which costs about 4 s for the 98k strings of a 49k-token vocabulary; this parser takes a
few tens of milliseconds. Tensor payloads stay memory-mapped and go through `gguf.quants.dequantize`.

File layout (GGUF v2/v3, little-endian):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key, u32 value type, value)           strings are u64 length + UTF-8 bytes
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64 offset)
    padding to `general.alignment` (default 32), then the tensor data; offsets are relative to it.

dims[0] is the fastest-varying axis, so the numpy shape is the reversed dims: [out, in] for a linear layer,
which is already HF's layout.
"""

from __future__ import annotations

import functools
import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from overnight.config import ModelArch, RopeValue
from overnight.errors import ModelLoadError
from overnight.loader.gguf_families import CONFIG_FAMILIES, hf_config
from overnight.loader.gguf_tensors import (
    GLOBAL_NAMES,
    HALF_PAIRS,
    LAYER_NAMES,
    PERMUTED,
    ExpertStacks,
    HalfPairs,
    LatentPairs,
    reshaped,
)
from overnight.models.gemma_config import gemma_arch

HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}
_GEMMA = ("gemma2", "gemma3")  # their ModelArch comes from models/gemma_config.py
# GGUF architecture -> ModelArch.architecture, where the names differ
_FAMILIES = {"qwen3moe": "qwen3_moe"}
# Files whose q/k rows the converter permuted for llama.cpp's interleaved RoPE (_unpermute_rope_rows);
# Mistral and Mixtral checkpoints convert to "llama" files.
_PERMUTED = ("llama", "granite", "smollm3")
_PARTIAL_ROTARY = ("phi3", "glm4")

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES = {t: np.dtype(f) for t, f in _SCALAR_FORMATS.items()}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: reversed GGUF dims
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]  # arrays of numbers are lists, strings are str
    tensors: dict[str, GGUFTensorInfo]


@dataclass(frozen=True)
class GGUFInfo:
    arch: ModelArch
    hf_architecture: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    chat_template: str | None
    max_position_embeddings: int
    tie_word_embeddings: bool


class _Cursor:
    """Sequential little-endian reads over the mapped header."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        # Vocabularies hold byte pieces that are not valid UTF-8 on their own.
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if item_type == GGUFValueType.STRING:
                return [self.string() for _ in range(count)]
            if item_type == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY) for _ in range(count)]
            dtype = _NUMPY_DTYPES[GGUFValueType(item_type)]
            items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return items.tolist()
        return self.scalar(_SCALAR_FORMATS[GGUFValueType(vtype)])


def read_gguf_file(path: str) -> GGUFFile:
    """Parse the header of a GGUF file (metadata and tensor table); cached per file version."""
    st = os.stat(path)
    return _read_gguf_file(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_gguf_file(path: str, size: int, mtime_ns: int) -> GGUFFile:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
        cur = _Cursor(buf)
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ModelLoadError(
                f"{path}: GGUF version {version} is not supported (need 2 or 3, little-endian)"
            )
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, cur.pos)
            cur.pos += 8 * n_dims
            raw.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in raw:
        ggml_type = GGMLQuantizationType(type_id)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        nbytes = int(np.prod(dims)) // block_size * type_size
        tensors[name] = GGUFTensorInfo(name, ggml_type, tuple(reversed(dims)), data_start + offset, nbytes)
    return GGUFFile(path, metadata, tensors)


@functools.cache
def _dequantizable(ggml_type: GGMLQuantizationType) -> bool:
    """Whether gguf.quants.dequantize reads this type (tried on one zero block)."""
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), ggml_type)
    except NotImplementedError:
        return False
    return True


def _f32(value: float) -> float:
    """The shortest decimal that rounds to the same float32: files store 1e-5 as 9.99999975e-06."""
    return float(str(np.float32(value)))


def read_gguf(path: str) -> GGUFInfo:
    """The architecture and generation facts of a GGUF checkpoint, without touching the weights."""
    f = read_gguf_file(path)
    md = f.metadata
    name = md.get("general.architecture")
    if name not in HF_ARCHITECTURES and name not in CONFIG_FAMILIES:
        supported = ", ".join([*HF_ARCHITECTURES, *CONFIG_FAMILIES])
        raise ModelLoadError(f"{path}: GGUF architecture {name!r} is not supported (supported: {supported})")
    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor")
    unreadable = sorted({t.ggml_type.name for t in f.tensors.values() if not _dequantizable(t.ggml_type)})
    if unreadable:  # refused before the model is built rather than midway through its weights
        first = next(t.name for t in f.tensors.values() if t.ggml_type.name in unreadable)
        raise ModelLoadError(
            f"{path}: GGUF tensor type {', '.join(unreadable)} cannot be dequantized (first: {first}); "
            "re-quantize the file to a type the gguf package reads (F32, F16, BF16, Q4_0..Q8_0, K- or "
            "I-quants, MXFP4)"
        )
    if name in CONFIG_FAMILIES:
        from overnight.models.registry import arch_from_hf_config  # the families' config.json reader

        experts = [t.ggml_type for t in f.tensors.values() if re.search(r"\.ffn_\w+_exps\.weight$", t.name)]
        mxfp4 = bool(experts) and all(t == GGMLQuantizationType.MXFP4 for t in experts)
        cfg = hf_config(md, f.tensors.keys(), path, embd.shape[0], _llama3_config(f, name), mxfp4)
        return _info(md, arch_from_hf_config(cfg), cfg["architectures"][0])

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{name}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {name}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts; only uniform ones fit a dense transformer
        if len(set(kv_heads)) != 1:
            raise ModelLoadError(
                f"{path}: per-layer KV head counts {sorted(set(kv_heads))} are not supported"
            )
        kv_heads = kv_heads[0]
    # rope.dimension_count is the rotated part of a head where rotation is partial (phi3, glm4).
    rotary_dims = None if name in _PARTIAL_ROTARY else md.get(f"{name}.rope.dimension_count")
    head_dim = int(md.get(f"{name}.attention.key_length") or rotary_dims or hidden // heads)
    theta = _f32(get("rope.freq_base", 10000.0))
    context = int(get("context_length"))
    tie = "output.weight" not in f.tensors
    moe = _moe_fields(f, name)
    family = "mixtral" if name == "llama" and moe else _FAMILIES.get(name, name)
    if name == "olmo2" and md.get(f"{name}.attention.sliding_window"):
        family = "olmo3"  # OLMo 3 converts to olmo2 files with a window
    scaling = _rope_scaling(f, name, head_dim, theta)
    gemma = _gemma_config(md, name, embd.shape[0], tie) if name in _GEMMA else None
    arch = (
        gemma_arch(gemma, name, HF_ARCHITECTURES[name])
        if gemma
        else ModelArch(
            architecture=family,
            # The embedding rows are what the weights need; converters pad the token list to match them.
            vocab_size=embd.shape[0],
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", md.get(f"{name}.expert_feed_forward_length"))),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=context,
            tie_word_embeddings=tie,
            attention_bias="blk.0.attn_q.bias" in f.tensors,
            o_proj_bias="blk.0.attn_output.bias" in f.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
            **moe,
            **_family_fields(f, name, head_dim, theta, scaling),
        )
    )
    hf_architecture = {"mixtral": "MixtralForCausalLM", "olmo3": "Olmo3ForCausalLM"}.get(
        family, HF_ARCHITECTURES[name]
    )
    return _info(md, arch, hf_architecture)


def _info(md: dict[str, Any], arch: ModelArch, hf_architecture: str) -> GGUFInfo:
    """The GGUFInfo of a file whose ModelArch is known: stop ids and chat template from the metadata."""
    # Stop on end-of-sequence and, where the file names them, end-of-turn / end-of-message.
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in md and int(md[key]) not in eos:
            eos.append(int(md[key]))
    bos = md.get("tokenizer.ggml.bos_token_id")
    return GGUFInfo(
        arch=arch,
        hf_architecture=hf_architecture,
        eos_token_ids=tuple(eos),
        bos_token_id=None if bos is None else int(bos),
        chat_template=md.get("tokenizer.chat_template"),
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
    )


def _llama3_config(f: GGUFFile, name: str) -> dict[str, Any] | None:
    """Llama 3 RoPE scaling as config.json states it, recovered from a rope_freqs tensor (_rope_scaling)."""
    if "rope_freqs.weight" not in f.tensors:
        return None
    md = f.metadata
    heads = int(md[f"{name}.attention.head_count"])
    head_dim = int(md.get(f"{name}.attention.key_length") or int(md[f"{name}.embedding_length"]) // heads)
    scaling = _rope_scaling(f, name, head_dim, _f32(md.get(f"{name}.rope.freq_base", 10000.0)))
    return None if scaling is None else {"rope_type": "llama3", **dict(scaling)}


def _gemma_config(md: dict[str, Any], name: str, vocab: int, tie: bool) -> dict[str, Any]:
    """A Gemma 2/3 GGUF's metadata as the config.json keys models/gemma_config.py reads, with the
    conventions of llama.cpp, which writes these files: the query scale is 1/sqrt(hidden / heads) for
    the 27B models (46 layers Gemma 2, 62 layers Gemma 3) and 1/sqrt(head_dim) otherwise; Gemma 3's
    sliding layers rotate with theta 10000, and one layer in six is full unless the file says which."""

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{name}.{key}", default)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    layers = int(get("block_count"))
    head_dim = int(get("attention.key_length") or hidden // heads)
    is_27b = layers == {"gemma2": 46, "gemma3": 62}[name]
    cfg: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=tie,
        sliding_window=int(get("attention.sliding_window", 4096)),
        query_pre_attn_scalar=hidden // heads if is_27b else head_dim,
        rope_theta=_f32(get("rope.freq_base", 10000.0 if name == "gemma2" else 1e6)),
        final_logit_softcapping=get("final_logit_softcapping"),
    )
    if name == "gemma2":
        cfg["attn_logit_softcapping"] = get("attn_logit_softcapping")
    else:
        cfg["rope_local_base_freq"] = 10000.0
        if get("rope.scaling.type", "none") == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": _f32(get("rope.scaling.factor"))}
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: true for a sliding layer
        cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern:
        cfg["sliding_window_pattern"] = int(pattern)
    return cfg


def _moe_fields(f: GGUFFile, name: str) -> dict[str, Any]:
    """ModelArch's mixture-of-experts fields: counts from the metadata, and every layer without a
    router tensor (ffn_gate_inp) among mlp_only_layers. llama.cpp renormalizes Qwen3-MoE's top-k
    weights unless the file says otherwise (expert_weights_norm)."""
    md = f.metadata
    experts = int(md.get(f"{name}.expert_count") or 0)
    if not experts:
        return {}
    if name == "llama":  # Mixtral: every layer sparse, the chosen experts' weights renormalized
        if "blk.0.ffn_gate_exps.weight" not in f.tensors:
            raise ModelLoadError(f"{f.path}: Mixtral GGUF files with per-expert tensors are not supported")
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(md[f"{name}.expert_used_count"]),
            moe_intermediate_size=int(
                md.get(f"{name}.expert_feed_forward_length") or md[f"{name}.feed_forward_length"]
            ),
            norm_topk_prob=True,
        )
    if name != "qwen3moe":
        raise ModelLoadError(
            f"{f.path}: mixture-of-experts GGUF files are supported for qwen3moe and llama (Mixtral) only, not {name}"
        )
    layers = int(md[f"{name}.block_count"])
    try:
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(md[f"{name}.expert_used_count"]),
            moe_intermediate_size=int(md[f"{name}.expert_feed_forward_length"]),
            norm_topk_prob=bool(md.get(f"{name}.expert_weights_norm", True)),
            mlp_only_layers=tuple(
                i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors
            ),
        )
    except KeyError as e:
        raise ModelLoadError(f"{f.path}: GGUF metadata lacks {e.args[0]}") from None


def _family_fields(
    f: GGUFFile, name: str, head_dim: int, theta: float, scaling: tuple[tuple[str, RopeValue], ...] | None
) -> dict[str, Any]:
    """ModelArch fields of the families whose blocks differ from Llama's (OLMo 2/3's post-norms,
    whole-projection q/k norms and windows, Granite's multipliers, Phi-3's partial rotary and window)."""
    md = f.metadata
    window = int(md.get(f"{name}.attention.sliding_window") or 0)
    layers = int(md[f"{name}.block_count"])
    if name == "olmo2":
        fields: dict[str, Any] = dict(norm_placement="post", qk_norm_whole=True)
        if window:  # OLMo 3: which layers are windowed, and their RoPE unscaled (as in HF's configs)
            pattern = md.get(f"{name}.attention.sliding_window_pattern")
            if not isinstance(pattern, list) or len(pattern) != layers:
                raise ModelLoadError(
                    f"{f.path}: {name}.attention.sliding_window_pattern must list every layer"
                )
            kinds = tuple("sliding_attention" if p else "full_attention" for p in pattern)
            if "sliding_attention" in kinds:
                fields.update(layer_types=kinds, sliding_window=window)
                if scaling is not None:
                    fields.update(sliding_rope_theta=theta)
        return fields
    if name == "phi3":  # the converter writes window 0 for none (Phi-4)
        rotary = int(md.get(f"{name}.rope.dimension_count") or head_dim)
        fields = dict(partial_rotary_factor=rotary / head_dim)
        if window:
            fields.update(layer_types=("sliding_attention",) * layers, sliding_window=window)
        return fields
    if window:
        raise ModelLoadError(f"{f.path}: sliding-window GGUF files ({name}) are not supported yet")
    if name == "smollm3":  # llama.cpp's fixed rule (no metadata): every 4th layer has no RoPE
        return dict(no_rope_layers=tuple(i for i in range(layers) if (i + 1) % 4 == 0))
    if name == "glm4":  # sandwich norms; part of each head rotates, in interleaved pairs (HF's layout)
        rotary = int(md.get(f"{name}.rope.dimension_count") or head_dim // 2)
        return dict(norm_placement="sandwich", partial_rotary_factor=rotary / head_dim, rope_interleaved=True)
    if name == "granite":
        return dict(
            attention_multiplier=_f32(md.get(f"{name}.attention.scale", 1.0)),
            embedding_multiplier=_f32(md.get(f"{name}.embedding_scale", 1.0)),
            residual_multiplier=_f32(md.get(f"{name}.residual_scale", 1.0)),
            logits_scaling=_f32(md.get(f"{name}.logit_scale", 1.0)),
        )
    return {}


def _rope_scaling(
    f: GGUFFile, name: str, head_dim: int, theta: float
) -> tuple[tuple[str, RopeValue], ...] | None:
    """Linear scaling (rope.scaling.type and .factor), or Llama 3 frequency scaling, recovered from the per-frequency divisors the converter stores.

    The file keeps `rope_freqs.weight[i]` = the divisor of inverse frequency i: 1 for short wavelengths,
    `factor` for long ones, and 1 / ((1 - s) / factor + s) between, where s = (orig / wavelen - low) /
    (high - low) is linear in 1 / wavelen. Two in-between points give that line's slope and intercept;
    any (orig, low, high) on it reproduce every divisor, so orig is taken from the metadata when present
    and otherwise set to Llama 3's 8192.
    """
    scaling_type = f.metadata.get(f"{name}.rope.scaling.type", "none")
    if "rope_factors_long.weight" in f.tensors:
        return _longrope_scaling(f, name)
    info = f.tensors.get("rope_freqs.weight")
    if info is None and scaling_type == "linear":
        return (("rope_type", "linear"), ("factor", _f32(f.metadata[f"{name}.rope.scaling.factor"])))
    if info is None and scaling_type == "yarn":
        return _yarn_scaling(f, name)
    if info is None:
        if scaling_type != "none":
            raise ModelLoadError(f"{f.path}: RoPE scaling type {scaling_type!r} is not supported")
        return None
    raw = np.fromfile(f.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    divisors = _dequantize(raw, info).astype(np.float64)
    factor = float(divisors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = inv_freq[: len(divisors)] / (2 * np.pi)  # 1 / wavelength
    mid = (divisors > 1.0 + 1e-4) & (divisors < factor - 1e-4 * factor)
    if mid.sum() < 2:
        raise ModelLoadError(f"{f.path}: cannot recover the Llama 3 RoPE scaling from rope_freqs.weight")
    s = (1.0 / divisors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(x[mid], s, 1)  # s = slope * x + intercept
    orig = float(f.metadata.get(f"{name}.rope.scaling.original_context_length", 8192))
    low = -intercept * orig / slope
    high = low + orig / slope
    return (
        ("factor", round(factor, 4)),
        ("low_freq_factor", round(float(low), 4)),
        ("high_freq_factor", round(float(high), 4)),
        ("original_max_position_embeddings", orig),
    )


def _yarn_scaling(f: GGUFFile, name: str) -> tuple[tuple[str, RopeValue], ...]:
    """YaRN from the metadata (the factor and original context; the attention factor and the betas where
    the file states them, transformers' defaults otherwise)."""
    md = f.metadata
    keys = {
        "factor": "rope.scaling.factor",
        "original_max_position_embeddings": "rope.scaling.original_context_length",
        "attention_factor": "rope.scaling.attn_factor",
        "beta_fast": "rope.scaling.yarn_beta_fast",
        "beta_slow": "rope.scaling.yarn_beta_slow",
    }
    items = {k: _f32(md[f"{name}.{key}"]) for k, key in keys.items() if f"{name}.{key}" in md}
    for required in ("factor", "original_max_position_embeddings"):
        if required not in items:
            raise ModelLoadError(f"{f.path}: YaRN RoPE scaling without {name}.{keys[required]}")
    return (("rope_type", "yarn"), *sorted(items.items()))


def _longrope_scaling(f: GGUFFile, name: str) -> tuple[tuple[str, RopeValue], ...]:
    """Phi-3's LongRoPE: its short and long per-frequency factors are tensors of the file."""
    factors = {}
    for kind in ("short", "long"):
        info = f.tensors.get(f"rope_factors_{kind}.weight")
        if info is None:
            raise ModelLoadError(f"{f.path}: rope_factors_long without rope_factors_short")
        raw = np.fromfile(f.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        factors[kind] = tuple(_f32(x) for x in _dequantize(raw, info).reshape(-1))
    md = f.metadata
    orig = md.get(f"{name}.rope.scaling.original_context_length")
    if orig is None:
        raise ModelLoadError(f"{f.path}: GGUF metadata lacks {name}.rope.scaling.original_context_length")
    items: dict[str, RopeValue] = {
        "long_factor": factors["long"],
        "original_max_position_embeddings": float(orig),
        "short_factor": factors["short"],
    }
    if f"{name}.rope.scaling.attn_factor" in md:
        items["attention_factor"] = _f32(md[f"{name}.rope.scaling.attn_factor"])
    return (("rope_type", "longrope"), *sorted(items.items()))


# GGUF tensor name suffix -> HF name suffix, per decoder layer.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # OLMo 2: after attention
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",  # OLMo 2: after the MLP
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3: fused q/k/v
}
# Where an architecture's files name a tensor their own way: Phi-3's and GLM-4's ffn_up hold gate and up,
# GLM-4's norms after attention and the MLP.
_GEMMA_LAYER_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_ARCH_LAYER_NAMES = {
    "gemma2": _GEMMA_LAYER_NAMES,
    "gemma3": _GEMMA_LAYER_NAMES,
    "phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"},
    "glm4": {
        "ffn_up.weight": "mlp.gate_up_proj.weight",
        "post_attention_norm.weight": "post_self_attn_layernorm.weight",
        "post_ffw_norm.weight": "post_mlp_layernorm.weight",
    },
}
# Stacked experts [E, out, in] -> the checkpoint's per-expert projection (mlp.experts.N.<name>.weight)
_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Gemma's sandwich norms (llama.cpp writes its pre-feedforward norm as ffn_norm); the file stores every
# Gemma norm as 1 + w, taken back to the checkpoint's w as it loads (models/gemma.py adds the 1 again).
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
# Tensors that carry no weights of their own: the RoPE divisors are folded into ModelArch.rope_scaling.
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def hf_name(gguf_name: str, arch: str = "") -> str | None:
    """The HF state-dict name of a GGUF tensor of a file of architecture `arch`, or None when the tensor
    has no HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


def _stacked_experts(gguf_name: str) -> tuple[str, str] | None:
    """(HF prefix "model.layers.N.mlp.experts", projection) for a stacked-experts tensor, else None."""
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _EXPERT_NAMES:
        return f"model.layers.{m.group(1)}.mlp.experts", _EXPERT_NAMES[m.group(2)]
    return None


# Values dequantized per call: large enough to amortize numpy's per-call overhead, small enough that the
# temporaries stay in cache (whole-tensor calls on big embeddings are slower and need gigabytes).
_CHUNK_VALUES = 1 << 18


def _dequantize(raw: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """A tensor's raw bytes -> a fresh, writable float32 array of its numpy shape."""
    block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
    out = np.empty(int(np.prod(info.shape)), dtype=np.float32)
    step_blocks = max(1, _CHUNK_VALUES // block_size)
    for first in range(0, out.size // block_size, step_blocks):
        n_blocks = min(step_blocks, out.size // block_size - first)
        chunk = raw[first * type_size : (first + n_blocks) * type_size]
        # One row of whole blocks; the quant kernels vectorize over the blocks of a row.
        values = dequantize(chunk.reshape(1, -1), info.ggml_type)
        out[first * block_size : (first + n_blocks) * block_size] = values.reshape(-1)
    return out.reshape(info.shape)


def _weights_of(data: np.ndarray, info: GGUFTensorInfo, path: str) -> np.ndarray:
    try:
        return _dequantize(data[info.offset : info.offset + info.nbytes], info)
    except NotImplementedError as e:
        raise ModelLoadError(f"{path}: cannot dequantize {info.name} ({info.ggml_type.name}): {e}") from e


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the converter's row order for llama q/k projections.

    The converter stores each head's rows as [pair 0 first halves.. | pair 0 second halves..] reordered
    so that rotating adjacent rows (interleaved RoPE) equals HF's rotate_half on the original order:
    stored row (h, 2*i + j) is original row (h, j * half + i). Reading the stored rows as
    [head, i, j] and swapping i and j restores [head, j, i] = the original order.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor in HF layout) for every weight of a GGUF checkpoint: float32, but for
    gpt-oss's MXFP4 experts (uint8 blocks and scales, kept packed)."""
    info = read_gguf(path)
    f = read_gguf_file(path)
    if f.metadata["general.architecture"] in CONFIG_FAMILIES:
        yield from _config_family_weights(f, info.arch)
        return
    permute = f.metadata.get("general.architecture") in _PERMUTED
    gemma = info.arch.architecture in _GEMMA
    with open(f.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        data = np.frombuffer(buf, dtype=np.uint8)
        for t in f.tensors.values():
            stacked = _stacked_experts(t.name)
            if stacked is not None:  # [E, out, in]: one HF tensor per expert, as HF checkpoints have them
                prefix, projection = stacked
                experts = _weights_of(data, t, path)
                for expert in range(experts.shape[0]):
                    yield f"{prefix}.{expert}.{projection}.weight", torch.from_numpy(experts[expert])
                continue
            name = hf_name(t.name, f.metadata.get("general.architecture", ""))
            if name is None:
                if t.name in _SKIPPED:
                    continue
                raise ModelLoadError(f"{path}: unexpected GGUF tensor {t.name!r}")
            w = _weights_of(data, t, path)
            if gemma and name.endswith("norm.weight"):
                w = w - 1.0
            if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
                w = _unpermute_rope_rows(w, info.arch.num_attention_heads)
            elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
                w = _unpermute_rope_rows(w, info.arch.num_key_value_heads)
            yield name, torch.from_numpy(np.ascontiguousarray(w))
        del data  # the mapping cannot close while a numpy view of it is alive


def _config_family_weights(f: GGUFFile, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of a gguf_families.CONFIG_FAMILIES file under HF names."""
    family = f.metadata["general.architecture"]
    names = LAYER_NAMES[family]
    packed = arch.experts_mxfp4  # gpt-oss's MXFP4 experts stay packed (gguf_families.hf_config)
    globals_ = {**_GLOBAL_NAMES, **GLOBAL_NAMES.get(family, {})}
    experts, latent, halves = ExpertStacks(), LatentPairs(), HalfPairs(HALF_PAIRS.get(family, {}))
    with open(f.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        data = np.frombuffer(buf, dtype=np.uint8)
        for t in f.tensors.values():
            m = _LAYER_RE.fullmatch(t.name)
            suffix = m.group(2) if m else ""
            if m and suffix in halves.table:
                pairs = halves.tensors(m.group(1), suffix, _weights_of(data, t, f.path))
            elif m and packed and ExpertStacks.handles(suffix) and t.ggml_type == GGMLQuantizationType.MXFP4:
                # (the bytes' view is not kept: the mapping cannot close while one is alive)
                raw_bytes = data[t.offset : t.offset + t.nbytes]
                pairs = experts.packed(m.group(1), suffix, raw_bytes.reshape(*t.shape[:-1], -1))
                del raw_bytes
            elif m and ExpertStacks.handles(suffix) and suffix not in names:
                pairs = experts.tensors(m.group(1), suffix, _weights_of(data, t, f.path))
            elif m and LatentPairs.handles(suffix):
                pairs = latent.tensors(m.group(1), suffix, _weights_of(data, t, f.path))
            elif m and suffix in names:
                hf = f"model.layers.{m.group(1)}.{names[suffix]}"
                w = reshaped(hf, _weights_of(data, t, f.path))
                if family in PERMUTED and hf.endswith(("q_proj.weight", "k_proj.weight")):
                    heads = arch.num_attention_heads if "q_proj" in hf else arch.num_key_value_heads
                    w = _unpermute_rope_rows(w, heads)
                pairs = [(hf, w)]
            elif t.name in globals_:
                pairs = [(globals_[t.name], _weights_of(data, t, f.path))]
            elif t.name in _SKIPPED:
                continue
            else:
                raise ModelLoadError(f"{f.path}: unexpected GGUF tensor {t.name!r}")
            for name, w in pairs:
                yield name, torch.from_numpy(np.ascontiguousarray(w))
        del data  # the mapping cannot close while a numpy view of it is alive
    experts.check_done(f.path)
    latent.check_done(f.path)
    halves.check_done(f.path)
