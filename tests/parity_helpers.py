"""What the parity tests share: prompts and transformers' greedy reference, GGUF tensor names, and the FP8
weights' agreement with the same model's dequantized weights."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.linear_state import LinearStateBatch
from overnight.attention.metadata import AttentionBatch
from overnight.attention.torch_backend import TorchAttentionBackend, build_metadata
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source

# ---------------------------------------------------------------- transformers' greedy reference


def prompts_for(vocab: int, n: int = 10, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 5, 9, 16, 17, 31, 40, 63, 100][:n]
    return [[rng.randrange(3, vocab) for _ in range(k)] for k in lengths]


def hf_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy generate with no end-of-sequence token (like ignore_eos: EOS may be drawn,
    it just does not stop anything; min_new_tokens would instead forbid it)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            eos_token_id=[],
            max_new_tokens=new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt) :].tolist(), [s[0].float().log_softmax(-1) for s in out.scores]


def cpu_model(folder: object, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Our model of the checkpoint in `folder`, on the CPU whatever the host has: for tests that compare
    its tensors with transformers' (which they run on the CPU) or with shards loaded on the CPU. An
    engine built without a device sits on the GPU of a GPU host, so its model cannot stand in."""
    return load_model(resolve_source(str(folder)), dtype, "cpu")


# ---------------------------------------------------------------- GGUF tensor names

# HF name suffix -> GGUF name suffix, as the GGUF converter names them.
LAYER_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

GLOBAL_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def to_gguf_name(name: str) -> str:
    if name in GLOBAL_TO_GGUF:
        return GLOBAL_TO_GGUF[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{LAYER_TO_GGUF[rest]}"


# ---------------------------------------------------------------- the FP8 weights' agreement

NEW_TOKENS = 4

MIN_TOP1, MAX_DLOGPROB, MIN_SAME_GREEDY = 0.85, 0.15, 0.5  # the last: a share of the prompts


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 20, (16,), generator=gen).tolist()
    return [torch.randint(3, 384, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = _prompts()


def logprobs(model: nn.Module, seqs: list[list[int]], block_size: int = 4) -> list[torch.Tensor]:
    """[len, vocab] float32 log-softmax for each sequence, all in one prefill step on a fresh cache."""
    arch: ModelArch = model.arch
    dev = next(model.parameters()).device  # the model's own device: on a GPU host the kernels run there
    lens = [len(s) for s in seqs]
    tables, used = [], 0
    for n in lens:
        blocks = -(-n // block_size)
        tables.append(list(range(used, used + blocks)))
        used += blocks
    caches = [  # each layer's own cache shape (one plane for latent attention)
        torch.zeros(
            arch.kv_planes, used, block_size, arch.layer_num_kv_heads(i), arch.layer_head_dim(i), device=dev
        )
        for i in range(arch.num_hidden_layers)
    ]
    meta = build_metadata(lens, lens, tables, block_size, device=dev)
    ids = torch.tensor([t for s in seqs for t in s], device=dev)
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    batch = AttentionBatch(meta, caches, TorchAttentionBackend(), states=fresh_states(arch, len(seqs), dev))
    with torch.inference_mode():
        hidden = model(ids, positions, batch)
        return list(model.compute_logits(hidden).float().log_softmax(-1).cpu().split(lens))


def fresh_states(arch: ModelArch, num_reqs: int, device: torch.device) -> LinearStateBatch | None:
    """A hybrid's linear-layer states for num_reqs requests that all start from zeros (slot i for
    request i, plus the scratch slot); None for a model without linear layers."""
    if not arch.num_linear_layers:
        return None
    (k, c), (h, dk, dv) = arch.linear_state_shapes()
    n = arch.num_linear_layers
    slots = list(range(num_reqs))
    return LinearStateBatch(
        conv=[torch.zeros(num_reqs + 1, k, c, device=device) for _ in range(n)],
        ssm=[torch.zeros(num_reqs + 1, h, dk, dv, device=device) for _ in range(n)],
        slot_ids=torch.tensor(slots, dtype=torch.int64, device=device),
        has_state=torch.zeros(num_reqs, device=device),
        slot_ids_cpu=slots,
        has_state_cpu=[False] * num_reqs,
    )


def greedy_tokens(model: nn.Module, prompts: list[list[int]], steps: int) -> list[list[int]]:
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        for seq, lp in zip(seqs, logprobs(model, seqs)):
            seq.append(int(lp[-1].argmax()))
    return [s[len(p) :] for s, p in zip(seqs, prompts)]


@dataclass
class Agreement:
    top1: float  # teacher-forced on the reference's greedy tokens
    mean_dlogprob: float  # |logprob difference| of the reference's tokens
    same_greedy: float  # share of the prompts whose greedy continuations are identical

    @property
    def ok(self) -> bool:
        return (
            self.top1 >= MIN_TOP1
            and self.mean_dlogprob <= MAX_DLOGPROB
            and self.same_greedy >= MIN_SAME_GREEDY
        )


def compare(
    model: nn.Module, reference: nn.Module, prompts: list[list[int]] = PROMPTS, steps: int = NEW_TOKENS
) -> Agreement:
    ref_tokens = greedy_tokens(reference, prompts, steps)
    own_tokens = greedy_tokens(model, prompts, steps)
    seqs = [p + t for p, t in zip(prompts, ref_tokens)]
    top1, dlp = [], []
    for prompt, tokens, got, ref in zip(
        prompts, ref_tokens, logprobs(model, seqs), logprobs(reference, seqs)
    ):
        rows, tok = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens)), torch.tensor(tokens)
        top1 += (got[rows].argmax(-1) == tok).tolist()
        dlp += (got[rows, tok] - ref[rows, tok]).abs().tolist()
    same = sum(a == b for a, b in zip(own_tokens, ref_tokens)) / len(prompts)
    return Agreement(sum(top1) / len(top1), sum(dlp) / len(dlp), same)
