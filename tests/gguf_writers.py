"""Tiny GGUF files written the way llama.cpp's converter writes them (gguf-py's writer, tensor map and
quantizers), for the GGUF tests of the families read through their config.json readers
(tests/test_gguf_moe_families.py, tests/test_gguf_dense_families.py); and the token check for tiny tied
models whose greedy tokens vary too little for tiny_moe.check_waves_token_exact."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from overnight import LLM


def round_trip(a: np.ndarray, qtype: Q) -> np.ndarray:
    """`a` through ggml's quantizer and back (blocks along the last axis, as the file stores them);
    quantizing the result again gives the same bytes, so the file holds exactly these values."""
    out = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
    again = gguf.quants.dequantize(gguf.quants.quantize(out, qtype), qtype)
    assert np.array_equal(again, out)
    return out


@torch.no_grad()
def quantize_in_place(param: torch.Tensor, qtype: Q, transposed: bool) -> None:
    """The reference's parameter as the file will hold it; `transposed`: the file stores its last two
    axes swapped (gpt-oss's [E, in, out] experts)."""
    a = param.numpy()
    a = round_trip(a.swapaxes(-1, -2).copy(), qtype).swapaxes(-1, -2) if transposed else round_trip(a, qtype)
    param.copy_(torch.from_numpy(np.ascontiguousarray(a)))


def converter_writer(path: Path, arch: str, cfg) -> gguf.GGUFWriter:
    """The metadata the converter's base class writes for any decoder."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") is not None:  # as the base converter
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if getattr(cfg, "rms_norm_eps", None) is not None:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts or getattr(cfg, "n_routed_experts", None):
        w.add_expert_count(experts or cfg.n_routed_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_eos_token_id(2)
    w.add_bos_token_id(1)
    return w


def finish(w: gguf.GGUFWriter, tensors: dict[str, np.ndarray], quant: dict[str, Q]) -> None:
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        if name in quant:
            w.add_tensor(name, gguf.quants.quantize(a, quant[name]), raw_dtype=quant[name])
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def mapped(sd: dict[str, torch.Tensor], arch: gguf.MODEL_ARCH, layers: int, special: Callable) -> dict:
    """GGUF name -> array: `special(name, array)` first (the family's reshapes; None: not handled),
    then gguf-py's tensor map for the rest."""
    names = gguf.get_tensor_name_map(arch, layers)
    out: dict[str, np.ndarray] = {}
    for name, t in sd.items():
        a = t.numpy().astype(np.float32)
        handled = special(name, a)
        if handled is not None:
            out.update(handled)
            continue
        # the converter's renames: gpt-oss's sinks gain .weight, the router's correction bias becomes .bias
        key = name.replace("e_score_correction_bias", "e_score_correction.bias")
        key = key if key.endswith((".weight", ".bias")) else key + ".weight"
        new = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        out[new] = a
    return out


def split_experts(name: str, a: np.ndarray) -> dict[str, np.ndarray] | None:
    """transformers 5's stacked experts ([E, 2I, H] gate rows first, [E, H, I]) as the converter stacks
    the per-expert tensors."""
    blk = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else ""
    if name.endswith("mlp.experts.gate_up_proj"):
        gate, up = np.split(a, 2, axis=1)
        return {f"{blk}.ffn_gate_exps.weight": gate, f"{blk}.ffn_up_exps.weight": up}
    if name.endswith("mlp.experts.down_proj"):
        return {f"{blk}.ffn_down_exps.weight": a}
    if name.endswith("gate.moe_statics.e_score_correction_bias"):  # transformers 5's name for ERNIE's
        return {f"{blk}.exp_probs_b.bias": a}
    return None


def check_tokens(llm: LLM, ref, rounds) -> None:
    """tiny_moe.check_waves_token_exact for the tiny tied models, whose greedy tokens vary too little for
    its variety check: every prompt's tokens equal transformers', and so do the chosen tokens' logprobs
    (logit scale, norms and RoPE show there, not only in the argmax)."""
    from overnight import SamplingParams
    from tests.parity_helpers import hf_greedy
    from tests.tiny_moe import NEW_TOKENS

    prompts = [*rounds[0], *rounds[1]]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        expected, scores = hf_greedy(ref, prompt, NEW_TOKENS)
        got = out.outputs[0]
        assert list(got.token_ids) == expected, f"prompt of {len(prompt)} tokens"
        assert got.logprobs is not None
        for token, theirs, ours in zip(expected, scores, got.logprobs):
            assert ours[token].logprob == pytest.approx(float(theirs[token]), abs=1e-4)
