"""Falcon-H1 (FalconH1ForCausalLM: attention and a Mamba2 mixer side by side in every layer, muP multipliers
folded into the weights at load). Tier (a), in seconds: config.json -> ModelArch (every parameter counted
as transformers holds it, the state and KV shapes, the hybrid layers' cache keys), bad configs refused by
name, the 7B preset's published sizes. Tier (c), slow: fp32 greedy token-exact with transformers through
the LLM API on the torch path and the Triton interpreter path, prefill chunks cut inside prompts, a
prefix-cache hit through state snapshots, preemption with a tiny pool, tensor parallelism (2 gloo ranks)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from overnight.errors import ModelLoadError
from overnight.models.registry import arch_from_hf_config
from tests.tiny_hybrid import save_checkpoint
from tests.tiny_models import _spread_weights

ENGINE = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4)
VOCAB = 101

# Odd sizes: head_dim 12 (not hidden / heads), the mixer's width 40 (mamba_d_ssm, not expand * hidden),
# every multiplier away from 1.
_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    mamba_d_ssm=40,
    mamba_n_heads=4,
    mamba_d_head=10,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_chunk_size=16,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    embedding_multiplier=2.0,
    lm_head_multiplier=0.5,
    key_multiplier=0.7,
    attention_in_multiplier=1.3,
    attention_out_multiplier=0.8,
    ssm_in_multiplier=1.2,
    ssm_out_multiplier=0.9,
    ssm_multipliers=[0.6, 1.4, 0.8, 1.1, 1.5],
    mlp_multipliers=[1.3, 0.7],
    tie_word_embeddings=False,
)
# variant -> its config changes: one B/C group and no gated norm (the published models' form), two
# groups with the norm before the gate (transformers' default) and tied embeddings, two groups with
# the gate first
VARIANTS: dict[str, dict[str, Any]] = {
    "g1": dict(mamba_n_groups=1, mamba_rms_norm=False),
    "g2-norm": dict(
        mamba_n_groups=2,
        mamba_rms_norm=True,
        mamba_norm_before_gate=True,
        tie_word_embeddings=True,
        embedding_multiplier=0.1,  # tied: a larger one makes every logit favour the last token
    ),
    "g2-gate-first": dict(
        mamba_n_groups=2, mamba_rms_norm=True, mamba_norm_before_gate=False, attention_bias=True
    ),
}


def make_falcon_h1_model(variant: str, seed: int = 0):
    import transformers

    cfg = transformers.FalconH1Config(**{**_CONFIG, **VARIANTS[variant]})
    torch.manual_seed(seed)
    model = transformers.FalconH1ForCausalLM(cfg).eval()
    _spread_weights(model, seed)
    return model


def make_falcon_h1_checkpoint(tmp_path: Path, variant: str) -> Path:
    return save_checkpoint(make_falcon_h1_model(variant), Path(tmp_path) / f"tiny-falcon-h1-{variant}")


def config_of(variant: str) -> tuple[dict, Any]:
    model = make_falcon_h1_model(variant)
    return json.loads(model.config.to_json_string()), model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_arch_counts_every_parameter_and_the_state_shapes(variant: str) -> None:
    cfg, model = config_of(variant)
    arch = arch_from_hf_config(cfg)
    assert arch.architecture == "falcon_h1" and arch.is_mamba2
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())
    assert arch.layer_types == ("hybrid",) * 3 and arch.num_linear_layers == 3
    assert [arch.linear_state_index(i) for i in range(3)] == [0, 1, 2]
    assert not any(arch.is_linear_layer(i) for i in range(3))  # every layer keeps its KV cache
    g = arch.mamba_n_groups
    assert arch.linear_state_shapes() == ((3, 40 + 2 * g * 8), (4, 10, 8))
    assert arch.kv_bytes_per_token(4) == 3 * 2 * (2 * 12) * 4  # K and V, 2 heads of 12, 3 layers


def test_every_layer_keys_both_caches() -> None:
    """The KV layout gives each hybrid layer its own KV tensor; the model's mixers index the state
    cache 0, 1, 2 (the state cache's layers)."""
    from overnight.engine.kv_groups import KVCacheLayout
    from overnight.models.falcon_h1 import FalconH1ForCausalLM

    cfg, _ = config_of("g1")
    arch = arch_from_hf_config(cfg)
    layout = KVCacheLayout.from_arch(arch)
    assert sorted(layout.layer_tensor) == [0, 1, 2]
    with torch.device("meta"):
        model = FalconH1ForCausalLM(arch)
    assert [layer.mamba.state_index for layer in model.model.layers] == [0, 1, 2]
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2]


def test_multipliers_fold_into_the_weights() -> None:
    """Each folded tensor is the checkpoint's times its multipliers (a bias only the output-side ones),
    in_proj row by row; the final norm takes Llama's name. (The token-exact tests below check the
    forward pass.)"""
    from overnight.models.falcon_h1 import fold_multipliers

    cfg, model = config_of("g2-gate-first")
    arch = arch_from_hf_config(cfg)
    state = model.state_dict()
    folded = dict(fold_multipliers(arch, state.items()))
    p = "model.layers.1."
    assert torch.allclose(
        folded[p + "self_attn.k_proj.weight"], state[p + "self_attn.k_proj.weight"] * 1.3 * 0.7
    )
    assert torch.allclose(folded[p + "self_attn.k_proj.bias"], state[p + "self_attn.k_proj.bias"] * 0.7)
    assert torch.equal(folded[p + "self_attn.q_proj.bias"], state[p + "self_attn.q_proj.bias"])
    assert torch.allclose(folded[p + "self_attn.o_proj.bias"], state[p + "self_attn.o_proj.bias"] * 0.8)
    assert torch.allclose(
        folded[p + "feed_forward.down_proj.weight"], state[p + "feed_forward.down_proj.weight"] * 0.7
    )
    rows = folded[p + "mamba.in_proj.weight"] / state[p + "mamba.in_proj.weight"]
    # z 40, x 40, B 16, C 16, dt 4 rows, each times ssm_in 1.2
    expected = torch.tensor([0.6] * 40 + [1.4] * 40 + [0.8] * 16 + [1.1] * 16 + [1.5] * 4) * 1.2
    assert torch.allclose(rows.mean(1), expected)
    assert "model.norm.weight" in folded and "model.final_layernorm.weight" not in folded


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(mamba_d_head=12), "mamba_n_heads 4 x mamba_d_head 12"),
        (dict(mamba_n_groups=3), "mamba_n_groups 3"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(mamba_d_conv=1), "mamba_d_conv must be at least 2"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(projectors_bias=True), "projectors_bias must agree"),
        (dict(ssm_multipliers=[1.0, 2.0]), "ssm_multipliers must be a list of 5"),
        (dict(mlp_multipliers=None, time_step_limit=[0.0, "lots"]), "time_step_limit holds 'lots'"),
    ],
)
def test_bad_configs_are_refused_by_name(change: dict, message: str) -> None:
    cfg, _ = config_of("g1")
    with pytest.raises(ModelLoadError, match=message):
        arch_from_hf_config({**cfg, **change})


def test_tensor_parallelism_without_whole_norm_groups_is_refused_by_name() -> None:
    """The norm before the gate sums no statistics over ranks: 2 groups split over 2 ranks, not 4."""
    from overnight.parallel.tp_shards import TPShards

    cfg, _ = config_of("g2-norm")
    arch = arch_from_hf_config(cfg)
    TPShards(arch, 0, 2).check()
    with pytest.raises(ModelLoadError, match="mamba_norm_before_gate"):
        TPShards(arch, 0, 4).check()


def test_the_7b_preset_counts_its_published_sizes() -> None:
    """tiiuae/Falcon-H1-7B-Instruct's config: 44 hybrid layers of 3072, 12 query and 2 KV heads of 128,
    24 Mamba2 heads of 128 (d_ssm 3072), d_state 256, one group; untied embeddings of 130,048: 7.6B."""
    from overnight.loader.resolve import resolve_source

    arch = resolve_source("falcon-h1-7b", load_format="dummy").arch
    assert arch.architecture == "falcon_h1" and arch.num_linear_layers == 44
    assert arch.mamba_intermediate == 3072 and not arch.tie_word_embeddings
    assert 7.4e9 < arch.num_parameters() < 7.8e9
    # a request's states: 44 x (conv 3 x (3072 + 2 x 256) float32 + SSM 24 heads x 128 x 256 float32)
    assert arch.linear_state_bytes() == 44 * (4 * 3 * 3584 + 4 * 24 * 128 * 256)
    assert arch.kv_bytes_per_token(2) == 44 * 2 * 2 * 128 * 2  # every layer, K and V


# ---------------------------------------------------------------------------------------------------
# Tier (c): against transformers through the LLM API


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    import transformers

    folder = make_falcon_h1_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, ref


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def check(llm: Any, ref: Any, prompts: list[list[int]], new_tokens: int) -> None:
    from overnight import SamplingParams
    from tests.test_engine_parity import hf_greedy

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, new_tokens)[0], (
            f"{len(prompt)} tokens"
        )


@pytest.mark.slow
def test_token_exact_with_chunked_prefill(checkpoint) -> None:
    """Chunks of 24 tokens: the longer prompts are cut inside, mixed with other requests' decodes."""
    from overnight import LLM

    _, folder, ref = checkpoint
    llm = LLM(str(folder), max_num_batched_tokens=24, max_num_seqs=4, max_model_len=256, **ENGINE)
    check(llm, ref, prompts_of([1, 5, 23, 60], seed=1), 8)


@pytest.mark.slow
def test_token_exact_on_the_triton_path(checkpoint, monkeypatch) -> None:
    """Every layer on its GPU path (Mamba2 decode step and varlen prefill kernels, paged attention,
    the norms) through the Triton interpreter."""
    from overnight import LLM
    from overnight.kernels import dispatch

    model, folder, ref = checkpoint
    if model != "g2-gate-first":
        pytest.skip("the interpreter is slow: the two-group variant with the gated-norm kernel runs it")
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    llm = LLM(str(folder), max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128, **ENGINE)
    check(llm, ref, prompts_of([1, 9, 30], seed=2), 5)


@pytest.mark.slow
def test_shared_prefix_hits_through_state_snapshots(checkpoint) -> None:
    from overnight import LLM

    model, folder, ref = checkpoint
    if model != "g1":
        pytest.skip("snapshots are the mixer's states: one variant is enough")
    rng = random.Random(5)
    system = [rng.randrange(3, VOCAB) for _ in range(50)]
    llm = LLM(str(folder), max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256, **ENGINE)
    # the second first-wave prompt meets the system prompt's end as a KV hit and snapshots it there
    check(llm, ref, [system + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (5, 9)], 4)
    before = llm.engine.stats().prefix_cache_hits  # type: ignore[attr-defined]
    check(llm, ref, [system + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (3, 7)], 4)
    hits = llm.engine.stats().prefix_cache_hits - before  # type: ignore[attr-defined]
    assert hits >= 2 * 48  # both second-wave prompts start past the system prompt's 12 full blocks


@pytest.mark.slow
def test_preemption_restarts_from_a_zero_state(checkpoint) -> None:
    from overnight import LLM
    from tests.test_hybrid_models import run_engine

    model, folder, ref = checkpoint
    if model != "g2-norm":
        pytest.skip("preemption runs on one variant")
    from tests.test_engine_parity import hf_greedy

    prompts = prompts_of([5, 13, 30, 9, 21], seed=3)
    state = 3 * (4 * 3 * (40 + 2 * 2 * 8) + 4 * 4 * 10 * 8)  # one request's float32 states
    block_bytes = 4 * 2 * 2 * 12 * 3 * 4  # 4 tokens x (K, V) x 2 heads of 12 x 3 layers x fp32
    llm = LLM(
        str(folder),
        kv_cache_memory_bytes=state * (5 + 1) + 20 * block_bytes,  # max_num_seqs + 1 slots
        max_num_batched_tokens=16,
        max_num_seqs=5,
        max_model_len=64,
        enable_prefix_caching=False,
        admission="greedy",  # start whatever fits now, so that running requests outgrow the pool
        **ENGINE,
    )
    assert llm.engine.pool_plan.num_blocks == 20  # type: ignore[attr-defined]
    for prompt, got in zip(prompts, run_engine(llm, prompts, 20)):
        assert got == hf_greedy(ref, prompt, 20)[0], f"{len(prompt)} tokens"
    assert llm.engine.stats().num_preemptions_total > 0  # type: ignore[attr-defined]


@pytest.mark.slow
def test_bf16_close_to_transformers(checkpoint) -> None:
    """bf16 on both sides, the house rule: greedy tokens equal up to the first divergence, there each
    side's token among the other's top 5; and at least half the steps before divergences, with the chosen
    tokens' logprobs 0.05 apart on average (so a model that diverges at once fails)."""
    import transformers

    from overnight import LLM, SamplingParams
    from tests.parity_helpers import hf_greedy

    model, folder, _ = checkpoint
    if model != "g1":
        pytest.skip("one variant: the published models' form")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    llm = LLM(str(folder), **dict(ENGINE, dtype="bfloat16"), max_model_len=128, max_num_batched_tokens=16)
    prompts, new = prompts_of([1, 4, 9, 17, 30, 41], seed=7), 8
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    gaps: list[float] = []
    for prompt, out in zip(prompts, outs):
        theirs, scores = hf_greedy(ref, prompt, new)
        ours, logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
        assert logprobs is not None
        for a, b, their_lp, lp in zip(ours, theirs, scores, logprobs):
            if a != b:
                assert b in lp and a in their_lp.topk(5).indices.tolist(), f"{ours} vs {theirs}"
                break
            gaps.append(abs(lp[a].logprob - float(their_lp[a])))
    assert len(gaps) >= len(prompts) * new / 2, f"{len(gaps)} steps before divergences"
    assert sum(gaps) / len(gaps) < 0.05, f"mean logprob gap {sum(gaps) / len(gaps):.3f}"


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("variant", ["g1", "g2-norm"])
def test_decode_steps_have_no_host_syncs(tmp_path, monkeypatch, variant: str) -> None:
    """What CUDA-graph capture forbids (tests/sync_guard.py), in float16 with every layer on its GPU
    path: the Mamba2 decode step beside paged attention, y * silu(z) without a norm, or the norm
    before the gate."""
    from tests.test_graph_safety import decode_guarded

    decode_guarded(make_falcon_h1_checkpoint(tmp_path, variant), monkeypatch)


@pytest.mark.slow  # starts tensor-parallel processes
@pytest.mark.parametrize("variant", ["g1", "g2-norm"])
def test_tp2_matches_tp1_and_transformers(tmp_path, variant: str) -> None:
    """parallel/tp_mamba2.py's rules with the attention ones: the mixer's heads split (its one B/C group
    on both ranks, no norm; or the two groups split, each rank normalizing its own group before the
    gate), the attention's heads split,
    the MLP split; both prefix waves (chunked prefill, a second wave restored from state snapshots) give
    the tokens of one process and of transformers."""
    from tests.tp_helpers import check_tp2_two_waves

    engine = dict(ENGINE, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256)
    check_tp2_two_waves(make_falcon_h1_checkpoint(tmp_path, variant), engine, VOCAB, seed=5)


def test_pre_quantized_tensors_are_refused_by_name() -> None:
    """A scale or a packed weight of a multiplied projection cannot take the multiplier as a float
    weight does: refused, naming the tensor."""
    from overnight.models.falcon_h1 import fold_multipliers

    cfg, _ = config_of("g1")
    arch = arch_from_hf_config(cfg)
    for name, t in [
        ("model.layers.0.self_attn.k_proj.weight_scale", torch.ones(24)),
        ("model.layers.0.mamba.in_proj.qweight", torch.ones(4, 100, dtype=torch.int32)),
    ]:
        with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
            list(fold_multipliers(arch, [(name, t)]))
