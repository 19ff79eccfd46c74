"""A GGUF checkpoint's weights as HF-named tensors in HF's layout (iter_gguf_weights): float32, but for
gpt-oss's MXFP4 experts (the published checkpoints' uint8 blocks and scales, kept packed). The tensor
names of the families read here are mapped below (hf_name); those of the families read through their
config.json reader are gguf_tensors.py's.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.loader.gguf_config import GEMMA_FAMILIES, read_gguf
from overnight.loader.gguf_families import CONFIG_FAMILIES
from overnight.loader.gguf_file import GGUFFile, read_gguf_file, read_tensor
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

# Files whose q/k rows the converter permuted for llama.cpp's interleaved RoPE (_unpermute_rope_rows);
# Mistral and Mixtral checkpoints convert to "llama" files.
_PERMUTED = ("llama", "granite", "smollm3")

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
# Gemma's sandwich norms (llama.cpp writes its pre-feedforward norm as ffn_norm); the file stores every
# Gemma norm as 1 + w, taken back to the checkpoint's w as it loads (models/gemma.py adds the 1 again).
_GEMMA_LAYER_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Where an architecture's files name a tensor their own way: Phi-3's and GLM-4's ffn_up hold gate and up,
# GLM-4's norms after attention and the MLP.
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
    gemma = info.arch.architecture in GEMMA_FAMILIES
    with open(f.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        data = np.frombuffer(buf, dtype=np.uint8)
        for t in f.tensors.values():
            stacked = _stacked_experts(t.name)
            if stacked is not None:  # [E, out, in]: one HF tensor per expert, as HF checkpoints have them
                prefix, projection = stacked
                experts = read_tensor(data, t, path)
                for expert in range(experts.shape[0]):
                    yield f"{prefix}.{expert}.{projection}.weight", torch.from_numpy(experts[expert])
                continue
            name = hf_name(t.name, f.metadata.get("general.architecture", ""))
            if name is None:
                if t.name in _SKIPPED:
                    continue
                raise ModelLoadError(f"{path}: unexpected GGUF tensor {t.name!r}")
            w = read_tensor(data, t, path)
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
                pairs = halves.tensors(m.group(1), suffix, read_tensor(data, t, f.path))
            elif m and packed and ExpertStacks.handles(suffix) and t.ggml_type == GGMLQuantizationType.MXFP4:
                # (the bytes' view is not kept: the mapping cannot close while one is alive)
                raw_bytes = data[t.offset : t.offset + t.nbytes]
                pairs = experts.packed(m.group(1), suffix, raw_bytes.reshape(*t.shape[:-1], -1))
                del raw_bytes
            elif m and ExpertStacks.handles(suffix) and suffix not in names:
                pairs = experts.tensors(m.group(1), suffix, read_tensor(data, t, f.path))
            elif m and LatentPairs.handles(suffix):
                pairs = latent.tensors(m.group(1), suffix, read_tensor(data, t, f.path))
            elif m and suffix in names:
                hf = f"model.layers.{m.group(1)}.{names[suffix]}"
                w = reshaped(hf, read_tensor(data, t, f.path))
                if family in PERMUTED and hf.endswith(("q_proj.weight", "k_proj.weight")):
                    heads = arch.num_attention_heads if "q_proj" in hf else arch.num_key_value_heads
                    w = _unpermute_rope_rows(w, heads)
                pairs = [(hf, w)]
            elif t.name in globals_:
                pairs = [(globals_[t.name], read_tensor(data, t, f.path))]
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
