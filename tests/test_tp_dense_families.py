"""Tensor parallelism for OLMo 2 / OLMo 3, whose q and k RMSNorms span the whole projections (every
head of a token): each rank keeps its heads' rows of the norm weights, and the per-token sums of squares
of q and k are summed over the ranks (one [tokens, 2] all-reduce a layer) before the mean.

The norm arithmetic is checked in one process against the unsharded norm, the rank-by-rank loading in
tests/test_families.py, and the whole model with 2 gloo rank processes against one process and HF
transformers.
"""

from __future__ import annotations

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.layers.norm import RMSNorm, sharded_rms_norm_pair
from overnight.loader.resolve import resolve_source
from overnight.parallel.tp_shards import TPShards
from tests.parity_helpers import hf_greedy, prompts_for
from tests.tiny_families import load_family_reference, make_family_checkpoint
from tests.tp_helpers import generate_split

OPTIONS = dict(
    device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16
)


def _norm(size: int, seed: int) -> RMSNorm:
    norm = RMSNorm(size, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(size, generator=torch.Generator().manual_seed(seed)) + 0.5)
    return norm


@pytest.mark.parametrize("kv_heads", [2, 1])  # one kv head a rank; one kv head held by both ranks
def test_sharded_whole_qk_norm_equals_the_whole_norm(kv_heads):
    """Each rank's share of norm(q) and norm(k), from its own share of q and k and the summed squares,
    is the matching share of the unsharded norms (k replicated on both ranks when there is one kv head)."""
    torch.manual_seed(0)
    d, heads, world, tokens = 8, 4, 2, 5
    q, k = torch.randn(tokens, heads * d) * 3, torch.randn(tokens, kv_heads * d)
    q_norm, k_norm = _norm(heads * d, 1), _norm(kv_heads * d, 2)
    whole_q, whole_k = q_norm(q), k_norm(k)

    def share(rank: int) -> tuple[torch.Tensor, torch.Tensor, RMSNorm, RMSNorm]:
        qs, kn = heads * d // world, max(1, kv_heads // world) * d
        k0 = rank * kv_heads // world * d
        return (q[:, rank * qs : (rank + 1) * qs], k[:, k0 : k0 + kn],
                _slice(q_norm, rank * qs, qs), _slice(k_norm, k0, kn))  # fmt: skip

    squares: list[torch.Tensor] = []  # first pass: each rank's own sums; second: their sum
    for rank in range(world):
        sharded_rms_norm_pair(*share(rank), world, lambda t: squares.append(t.clone()))
    total = sum(squares)
    for rank in range(world):
        sq, sk, nq, nk = share(rank)
        got_q, got_k = sharded_rms_norm_pair(sq, sk, nq, nk, world, lambda t: t.copy_(total))
        assert torch.allclose(got_q, whole_q[:, rank * sq.shape[1] : (rank + 1) * sq.shape[1]], atol=1e-5)
        k0 = rank * kv_heads // world * d
        assert torch.allclose(got_k, whole_k[:, k0 : k0 + sk.shape[1]], atol=1e-5)


def _slice(norm: RMSNorm, start: int, n: int) -> RMSNorm:
    part = RMSNorm(n, eps=norm.variance_epsilon)
    with torch.no_grad():
        part.weight.copy_(norm.weight[start : start + n])
    return part


def test_olmo_norm_weights_take_the_rows_of_the_heads(tmp_path):
    arch = resolve_source(str(make_family_checkpoint(tmp_path, "olmo2", num_key_value_heads=1))).arch
    q_w, k_w = torch.arange(arch.q_size, dtype=torch.float32), torch.arange(arch.kv_size, dtype=torch.float32)
    for rank in range(2):
        s = TPShards(arch, rank, 2)
        s.check()
        half = arch.q_size // 2
        assert torch.equal(
            s.shard("model.layers.0.self_attn.q_norm.weight", q_w), q_w[rank * half : (rank + 1) * half]
        )
        assert torch.equal(s.shard("model.layers.0.self_attn.k_norm.weight", k_w), k_w)  # the one kv head


def test_olmo_indivisible_heads_are_refused_by_name(tmp_path):
    folder = make_family_checkpoint(
        tmp_path, "olmo2", num_attention_heads=3, num_key_value_heads=3, head_dim=16
    )
    with pytest.raises(ModelLoadError, match="does not divide the model's num_attention_heads 3"):
        TPShards(resolve_source(str(folder)).arch, 0, 2).check()


@pytest.mark.slow  # starts tensor-parallel processes
@pytest.mark.parametrize("variant,changes", [("olmo2", {}), ("olmo3", {"num_key_value_heads": 1})])
def test_olmo_tp2_matches_tp1_and_transformers(tmp_path, variant, changes):
    """OLMo 2 with a kv head a rank; OLMo 3 (sliding-window layers, YaRN) with its one kv head on both
    ranks. Chunked prefills of 16 tokens, then greedy decoding."""
    folder = make_family_checkpoint(tmp_path, variant, **changes)
    ref = load_family_reference(folder, variant)
    prompts = prompts_for(211, 6, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one = LLM(str(folder), **OPTIONS).generate(prompts, params, use_tqdm=False)
    two = generate_split(str(folder), prompts, params, **OPTIONS)
    tokens = [list(o.outputs[0].token_ids) for o in two]
    assert tokens == [list(o.outputs[0].token_ids) for o in one]
    assert tokens == [hf_greedy(ref, p, 8)[0] for p in prompts]


# -- Gemma 4 ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["gemma4", "gemma4-moe"])
def gemma4(request, tmp_path_factory):
    """tests/test_gemma.py's tiny Gemma 4s: 16-wide sliding heads (2 kv heads: one a rank), 24-wide full
    heads with k = v and 1 kv head (held by both ranks); the dense one with 2 KV-shared layers of
    double-wide MLPs and per-layer inputs (their table split by vocabulary rows), the MoE one with 5 experts of width 20 beside the MLP.
    (variant, folder, transformers model)."""
    from tests.test_gemma import tiny_gemma

    model = tiny_gemma(request.param)
    folder = tmp_path_factory.mktemp(request.param) / "model"
    model.save_pretrained(folder)
    return request.param, folder, model


def test_gemma4_shards_streamed_equal_sliced(gemma4):
    """Each rank's weights streamed from the checkpoint (or drawn whole as dummies) equal those apply_tp
    cuts from the whole loaded model, and hold the layer's own head sizes and widths."""
    from overnight.loader.model_loader import load_model
    from overnight.parallel.tp import apply_tp
    from overnight.parallel.tp_load import load_sharded_model

    variant, folder, _ = gemma4
    for kind in ("auto", "dummy"):
        source = resolve_source(str(folder), kind)
        for rank in range(2):
            whole = apply_tp(load_model(source, torch.float32, "cpu", seed=3), rank, 2)
            streamed = load_sharded_model(source, torch.float32, "cpu", rank, 2, seed=3)
            a, b = dict(whole.named_parameters()), dict(streamed.named_parameters())
            assert a.keys() == b.keys()
            for name in a:
                assert torch.equal(a[name], b[name]), name
    layers = streamed.model.layers
    # sliding: 2 q heads of 16 + 1 kv head (k, v); full: 2 q heads of 24 + the shared kv head (k = v)
    assert layers[0].self_attn.qkv_proj.weight.shape[0] == 2 * 16 + 2 * 16
    assert layers[1].self_attn.qkv_proj.weight.shape[0] == 2 * 24 + 24
    if variant == "gemma4":  # layers 2, 3: KV-shared, q only, MLPs twice as wide
        assert layers[3].self_attn.q_proj.weight.shape[0] == 2 * 24
        assert layers[3].mlp.down_proj.weight.shape[1] == 80
        assert streamed.model.embed_tokens_per_layer.weight.shape == (166, 4 * 8)  # 331 rows, padded


def test_gemma4_indivisible_global_kv_heads_are_refused_by_name(gemma4):
    from dataclasses import replace

    arch = replace(resolve_source(str(gemma4[1])).arch, num_global_key_value_heads=3)
    with pytest.raises(ModelLoadError, match="does not divide the model's num_global_key_value_heads 3"):
        TPShards(arch, 0, 2).check()


@pytest.mark.slow  # starts tensor-parallel processes
def test_gemma4_tp2_matches_tp1_and_transformers(gemma4):
    """Chunked prefills past the 7-token window, a shared prefix (cache hits), greedy decoding."""
    from tests.test_gemma import agrees, prompts

    _, folder, model = gemma4
    batch = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    options = {**OPTIONS, "max_model_len": 64}
    one = LLM(str(folder), **options).generate(batch, params, use_tqdm=False)
    two = generate_split(str(folder), batch, params, **options)
    tokens = [list(o.outputs[0].token_ids) for o in two]
    assert tokens == [list(o.outputs[0].token_ids) for o in one]
    for prompt, got in zip(batch, tokens):
        ref, scores = hf_greedy(model, prompt, 8)
        assert agrees(got, ref, scores), prompt


# Quantized Gemma 4 (FP8, packed integers) under tensor parallelism: tests/test_tp_gemma4_quant.py
