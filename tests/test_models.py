"""Our Llama / Qwen2 / Qwen3 against HF transformers on tiny random checkpoints, in fp32 on the CPU.

The model runs over the paged KV cache with the PyTorch attention backend, so these tests also check the
contract between the models and AttentionBatch (positions, decode rows, chunked prefill, batching).
"""

from __future__ import annotations

import pytest
import torch

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.attention.torch_backend import TorchAttentionBackend, build_metadata
from overnight.layers.norm import RMSNorm
from overnight.layers.rotary import RotaryEmbedding
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from tests.tiny_models import FAMILIES, load_reference, make_tiny_checkpoint

BLOCK_SIZE = 4  # small, so every sequence spans several blocks


class PagedCache:
    """Each layer's KV cache plus a per-request block table; blocks are handed out from the top down so
    that a request's blocks are neither contiguous nor in order."""

    def __init__(self, arch: ModelArch, num_blocks: int = 64, device: torch.device | str = "cpu") -> None:
        shape = (2, num_blocks, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
        self.device = torch.device(device)
        self.kv_caches = [torch.zeros(shape, device=self.device) for _ in range(arch.num_hidden_layers)]
        self.free = list(range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(
        self, model: torch.nn.Module, reqs: list[tuple[str, list[int]]], num_decodes: int = 0
    ) -> list[torch.Tensor]:
        """Run one step of new tokens for each (request, tokens); returns each request's logit rows."""
        query_lens, seq_lens, tables, positions = [], [], [], []
        for rid, tokens in reqs:
            start = self.lens.get(rid, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(rid, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            self.lens[rid] = end
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
            positions.extend(range(start, end))
        meta = build_metadata(
            query_lens, seq_lens, tables, BLOCK_SIZE, num_decodes=num_decodes, device=self.device
        )
        attn = AttentionBatch(meta, self.kv_caches, TorchAttentionBackend())
        input_ids = torch.tensor([t for _, tokens in reqs for t in tokens], device=self.device)
        with torch.inference_mode():
            hidden = model(input_ids, torch.tensor(positions, device=self.device), attn)
            logits = model.compute_logits(hidden)
        return list(logits.split(query_lens))


CASES = [(family, {}) for family in FAMILIES] + [("llama", {"tie_word_embeddings": True})]


@pytest.fixture(scope="module", params=CASES, ids=[f + ("-tied" if kw else "") for f, kw in CASES])
def pair(request, tmp_path_factory):
    """(our model, the transformers model) loaded from the same tiny checkpoint."""
    family, overrides = request.param
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("models"), family, **overrides)
    ours = load_model(resolve_source(str(folder)), torch.float32, "cpu")
    ref = load_reference(folder)
    ref.generation_config.eos_token_id = None  # always generate the full length
    return ours, ref


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    # fp32 rounding differs with the order of sums (the CPU's vector width picks it): logits of size ~10
    # move by ~1e-5 between two correct implementations, so the bound scales with the logits' size.
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(b.abs().max())))


def test_prefill_logits_match_transformers(pair):
    ours, ref = pair
    prompt = _prompt(90, seed=1)  # past the llama3 scaling's original context (64)
    (logits,) = PagedCache(ours.arch).step(ours, [("a", prompt)])
    with torch.inference_mode():
        expected = ref(torch.tensor([prompt])).logits[0]
    assert logits.dtype == torch.float32 and logits.shape == (90, 384)
    _assert_close(logits, expected)


def test_greedy_decode_matches_generate(pair):
    ours, ref = pair
    prompt, steps = _prompt(9, seed=2), 20
    cache = PagedCache(ours.arch)
    (logits,) = cache.step(ours, [("a", prompt)])
    step_logits = [logits[-1]]
    generated = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        (logits,) = cache.step(ours, [("a", generated[-1:])], num_decodes=1)
        step_logits.append(logits[-1])
        generated.append(int(logits[-1].argmax()))
    with torch.inference_mode():
        out = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    assert generated == out.sequences[0, len(prompt) :].tolist()
    _assert_close(torch.stack(step_logits), torch.cat(out.scores))
    if not ours.arch.tie_word_embeddings:  # see tiny_models: tied random models repeat themselves
        assert len(set(generated)) > 5


def test_batch_matches_each_alone(pair):
    ours, _ = pair
    a, b = _prompt(11, seed=3), _prompt(17, seed=4)
    # Alone: a's prefill then one decode; b's prefill.
    alone = PagedCache(ours.arch)
    a_prefill = alone.step(ours, [("a", a)])[0]
    a_next = [int(a_prefill[-1].argmax())]
    a_decode = alone.step(ours, [("a", a_next)], num_decodes=1)[0]
    b_prefill = PagedCache(ours.arch).step(ours, [("b", b)])[0]
    # Together: both prefills in one step, then a's decode beside a fresh prefill of b.
    both = PagedCache(ours.arch)
    got_a, got_b = both.step(ours, [("a", a), ("b", b)])
    _assert_close(got_a, a_prefill)
    _assert_close(got_b, b_prefill)
    got_a, got_b = both.step(ours, [("a", a_next), ("b2", b)], num_decodes=1)
    _assert_close(got_a, a_decode)
    _assert_close(got_b, b_prefill)


def test_chunked_prefill_matches_unchunked(pair):
    ours, _ = pair
    prompt = _prompt(30, seed=5)
    (whole,) = PagedCache(ours.arch).step(ours, [("a", prompt)])
    cache = PagedCache(ours.arch)
    chunks = [cache.step(ours, [("a", prompt[i:j])])[0] for i, j in [(0, 11), (11, 13), (13, 30)]]
    _assert_close(torch.cat(chunks), whole)


def test_rotary_llama3_matches_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=1024,
        rope_scaling={"rope_type": "llama3", **scaling},
        rope_theta=50000.0,
    )
    ref = LlamaRotaryEmbedding(cfg)
    rope = RotaryEmbedding(64, 1024, 50000.0, scaling)
    positions = torch.tensor([0, 1, 5, 63, 64, 100, 511, 1023])
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, 4, 64, generator=gen), torch.randn(8, 2, 64, generator=gen)
    cos, sin = ref(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = rope(positions, q, k)
    assert torch.equal(q_out, q_ref[0].transpose(0, 1))
    assert torch.equal(k_out, k_ref[0].transpose(0, 1))


def test_rmsnorm_fused_residual():
    norm = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, residual = torch.randn(5, 32), torch.randn(5, 32)
    out, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(out, norm(x + residual))
    expected = norm.weight * (x + residual) / ((x + residual).pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(out, expected)
    half = norm.to(torch.bfloat16)(x.bfloat16())
    assert half.dtype == torch.bfloat16
