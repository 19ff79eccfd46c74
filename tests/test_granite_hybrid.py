"""Granite 4.0 hybrids (GraniteMoeHybridForCausalLM: Mamba2 + attention layers, dense or MoE with the
shared MLP). Tier (a), in seconds: config.json -> ModelArch (every parameter counted as transformers
holds it, the state shapes and bytes the pool plan reserves, the runner's state cache allocating that
plan), bad configs refused by name. Tier (c), slow: fp32 greedy token-exact against transformers through
the LLM API, on the torch path and on the Triton path (interpreter), with prefill chunks cut inside
prompts, a prefix-cache hit through state snapshots, and preemption with a tiny pool."""

from __future__ import annotations

import json
import random

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.models.registry import arch_from_hf_config
from tests.tiny_granite import VARIANTS, make_granite_checkpoint, make_granite_model

VOCAB = 101
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4)


def config_of(variant: str) -> dict:
    model = make_granite_model(variant)
    return json.loads(model.config.to_json_string()), model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_arch_counts_every_parameter_and_the_state_shapes(variant: str) -> None:
    cfg, model = config_of(variant)
    arch = arch_from_hf_config(cfg)
    assert arch.architecture == "granitemoehybrid" and arch.is_mamba2
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())
    assert arch.no_rope_layers == (() if cfg["position_embedding_type"] == "rope" else (0, 1, 2, 3))
    if variant == "attention-only":
        assert arch.num_linear_layers == 0 and arch.kv_bytes_per_token(4) == 4 * 2 * (2 * 8) * 4
        return
    assert arch.layer_types == ("linear_attention", "full_attention") * 2
    assert arch.num_linear_layers == 2 and arch.mamba_dt_limit == (0.0, float("inf"))
    # conv: K - 1 = 3 rows of x|B|C (4 heads x 16 + 2 groups x 2 x 8 = 96); SSM: heads x d_head x d_state
    assert arch.linear_state_shapes() == ((3, 96), (4, 16, 8))
    ssm32, ssm16 = 4 * 4 * 16 * 8, 2 * 4 * 16 * 8
    assert arch.linear_state_bytes() == 2 * (4 * 3 * 96 + ssm32)
    assert arch.linear_state_bytes(torch.bfloat16) == 2 * (4 * 3 * 96 + ssm16)
    # the KV cache: only the two attention layers (2 KV heads of 8)
    assert arch.kv_bytes_per_token(4) == 2 * 2 * (2 * 8) * 4


def test_the_runner_allocates_the_planned_mamba2_states(tmp_path) -> None:
    from overnight.build import build_config
    from overnight.engine.pool_plan import plan_states
    from overnight.loader.resolve import resolve_source
    from overnight.options import EngineOptions
    from overnight.runner.model_runner import ModelRunner

    folder = make_granite_checkpoint(tmp_path, "dense")
    opts = EngineOptions(
        model=str(folder),
        load_format="dummy",
        max_num_seqs=8,
        max_model_len=256,
        kv_cache_memory_bytes=1 << 20,
        mamba_ssm_cache_dtype="bfloat16",
        **ENGINE,
    )
    source = resolve_source(str(folder), "dummy")
    config = build_config(opts, source, torch.device("cpu"), None)
    runner = ModelRunner(config, source)
    plan = plan_states(config.model.arch, config.scheduler, config.cache)
    assert (plan.slots, plan.snapshots, plan.ssm_dtype) == (9, 4, torch.bfloat16)
    cache = runner.state_cache
    assert [tuple(c.shape) for c in cache.conv] == [(9, 3, 96)] * 2
    assert [(tuple(s.shape), s.dtype) for s in cache.ssm] == [((9, 4, 16, 8), torch.bfloat16)] * 2
    assert cache.nbytes == plan.total_bytes == 13 * 2 * (4 * 3 * 96 + 2 * 4 * 16 * 8)
    assert runner.kv_pool_share()[0] == (1 << 20) - plan.total_bytes


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(mamba_d_head=12), "mamba_n_heads 4 x mamba_d_head 12"),
        (dict(mamba_n_groups=3), "mamba_n_groups 3"),
        (dict(layer_types=["mamba", "conv", "mamba", "attention"]), "layer_types must name 4 layers"),
        (dict(position_embedding_type="alibi"), "position_embedding_type 'alibi'"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(mamba_d_conv=1), "mamba_d_conv must be at least 2"),
        (dict(time_step_limit=[0.0, "lots"]), "time_step_limit holds 'lots'"),
    ],
)
def test_bad_configs_are_refused_by_name(change: dict, message: str) -> None:
    cfg, _ = config_of("dense")
    with pytest.raises(ModelLoadError, match=message):
        arch_from_hf_config({**cfg, **change})


def test_published_layer_names_and_limits_are_read() -> None:
    """The published configs' "mamba" / "attention" names (layers_block_type in older ones) and a
    time_step_limit as transformers 5 writes infinity."""
    cfg, _ = config_of("moe")
    cfg.pop("layer_types")
    cfg["layers_block_type"] = ["mamba", "attention", "attention", "mamba"]
    cfg["time_step_limit"] = [0.001, {"__float__": "Infinity"}]
    arch = arch_from_hf_config(cfg)
    assert arch.layer_types == ("linear_attention", "full_attention", "full_attention", "linear_attention")
    assert arch.mamba_dt_limit == (0.001, float("inf"))


def test_both_checkpoint_layouts_load() -> None:
    """The published layout (block_sparse_moe.input_linear / output_linear / router.layer, as
    save_pretrained writes it) and transformers 5's in-memory names (experts.gate_up_proj / down_proj,
    router.weight) fill the same parameters."""
    from overnight.models.granite_hybrid import GraniteMoeHybridForCausalLM

    cfg, model = config_of("moe")
    arch = arch_from_hf_config(cfg)
    state = model.state_dict()
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in state  # transformers 5's names
    published = {
        k.replace("experts.gate_up_proj", "input_linear.weight")
        .replace("experts.down_proj", "output_linear.weight")
        .replace("router.weight", "router.layer.weight"): v
        for k, v in state.items()
    }
    ours = []
    for weights in (state, published):
        m = GraniteMoeHybridForCausalLM(arch)
        m.load_weights(weights.items())
        ours.append(dict(m.named_parameters()))
    for name, p in ours[0].items():
        assert torch.equal(p, ours[1][name]), name
    experts = ours[0]["model.layers.2.block_sparse_moe.experts.gate_up_proj"]
    assert torch.equal(experts, state["model.layers.2.block_sparse_moe.experts.gate_up_proj"])
    assert torch.equal(ours[0]["model.layers.0.mamba.conv1d.bias"], state["model.layers.0.mamba.conv1d.bias"])


def test_the_h_small_preset_counts_its_published_sizes() -> None:
    """ibm-granite/granite-4.0-h-small's config (32.2B parameters, 9B active; 36 Mamba2 layers, 4 NoPE
    attention layers at 5, 15, 25, 35; tied embeddings)."""
    from overnight.loader.resolve import resolve_source

    arch = resolve_source("granite-4.0-h-small", load_format="dummy").arch
    assert arch.architecture == "granitemoehybrid" and arch.num_linear_layers == 36
    assert [i for i in range(40) if not arch.is_linear_layer(i)] == [5, 15, 25, 35]
    assert arch.no_rope_layers == tuple(range(40)) and arch.tie_word_embeddings
    assert 32.1e9 < arch.num_parameters() < 32.3e9
    # a request's states: 36 x (conv 3 x 8,448 float32 + SSM 128 heads x 64 x 128)
    assert arch.linear_state_bytes() == 36 * (4 * 3 * 8448 + 4 * 128 * 64 * 128)
    assert arch.linear_state_bytes(torch.bfloat16) == 36 * (4 * 3 * 8448 + 2 * 128 * 64 * 128)
    assert arch.kv_bytes_per_token(2) == 4 * 2 * 8 * 128 * 2  # 4 attention layers, K and V


def test_tensor_parallelism_is_refused_by_name() -> None:
    from overnight.parallel.tp import TPShards

    arch = arch_from_hf_config(config_of("dense")[0])
    with pytest.raises(ModelLoadError, match="not supported yet for Mamba2"):
        TPShards(arch, 0, 2).check()
    TPShards(arch, 0, 1).check()


# ---------------------------------------------------------------------------------------------------
# tier (c): against transformers


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    import transformers

    folder = make_granite_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, ref


def check(llm: LLM, ref, prompts: list[list[int]], new_tokens: int) -> None:
    from tests.test_engine_parity import hf_greedy

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(new_tokens), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, new_tokens)[0], (
            f"{len(prompt)} tokens"
        )


@pytest.mark.slow
def test_token_exact_with_chunked_prefill(checkpoint) -> None:
    """Chunks of 24 tokens: the longer prompts are cut inside, mixed with other requests' decodes."""
    from tests.test_hybrid_models import assert_no_rows_held

    _, folder, ref = checkpoint
    llm = LLM(str(folder), max_num_batched_tokens=24, max_num_seqs=6, max_model_len=512, **ENGINE)
    check(llm, ref, prompts_of([1, 2, 5, 23, 40, 150], seed=1), 10)
    assert_no_rows_held(llm, 6)


@pytest.mark.slow
def test_token_exact_on_the_triton_path(checkpoint, monkeypatch) -> None:
    """Every layer on its GPU path (the Mamba2 decode step and varlen prefill kernels, conv step with
    its bias), through the Triton interpreter."""
    from overnight.kernels import dispatch

    variant, folder, ref = checkpoint
    if variant != "moe":
        pytest.skip("the interpreter is slow: one variant (MoE, RoPE) runs every kernel")
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    llm = LLM(str(folder), max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128, **ENGINE)
    check(llm, ref, prompts_of([1, 9, 30], seed=2), 6)


@pytest.mark.slow
def test_shared_prefix_hits_through_state_snapshots(checkpoint) -> None:
    from tests.test_hybrid_models import assert_no_rows_held

    variant, folder, ref = checkpoint
    if variant != "dense":
        pytest.skip("snapshots are the mixer's states: one variant is enough")
    rng = random.Random(5)
    system = [rng.randrange(3, VOCAB) for _ in range(90)]
    first = [system + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (9, 4)]
    second = [system + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (6, 1, 13)]
    llm = LLM(str(folder), max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256, **ENGINE)
    check(llm, ref, first, 6)
    before = llm.engine.stats().prefix_cache_hits  # type: ignore[attr-defined]
    check(llm, ref, second, 6)
    hits = llm.engine.stats().prefix_cache_hits - before  # type: ignore[attr-defined]
    assert hits >= 3 * 88  # every second-wave prompt starts past the system prompt's 22 full blocks
    assert_no_rows_held(llm, 4)


@pytest.mark.slow
def test_preemption_restarts_from_a_zero_state(checkpoint) -> None:
    from tests.test_engine_parity import hf_greedy
    from tests.test_hybrid_models import assert_no_rows_held, run_engine

    variant, folder, ref = checkpoint
    if variant != "moe":
        pytest.skip("preemption runs on the MoE variant")
    prompts = prompts_of([5, 13, 40, 57, 9, 30, 21], seed=3)
    state_bytes = 2 * (4 * 3 * 96 + 4 * 4 * 16 * 8) * (7 + 1)  # 2 Mamba2 layers x (max_num_seqs + 1)
    block_bytes = 4 * 2 * 2 * 8 * 2 * 4  # 4 tokens x (K, V) x 2 heads of 8 x 2 attention layers x fp32
    llm = LLM(
        str(folder),
        kv_cache_memory_bytes=state_bytes + 40 * block_bytes,
        max_num_batched_tokens=16,
        max_num_seqs=7,
        max_model_len=128,
        enable_prefix_caching=False,
        admission="greedy",  # start whatever fits now, so that running requests outgrow the pool
        **ENGINE,
    )
    assert llm.engine.pool_plan.num_blocks == 40  # type: ignore[attr-defined]
    for prompt, got in zip(prompts, run_engine(llm, prompts, 24)):
        assert got == hf_greedy(ref, prompt, 24)[0], f"{len(prompt)} tokens"
    assert llm.engine.stats().num_preemptions_total > 0  # type: ignore[attr-defined]
    assert_no_rows_held(llm, 7)


@pytest.mark.slow
def test_decode_steps_have_no_host_syncs(checkpoint, monkeypatch) -> None:
    """What CUDA-graph capture forbids (tests/sync_guard.py), in float16 with every layer on its GPU
    path: the Mamba2 decode (conv step with its bias, the SSD step kernel), the fused MoE, NoPE
    attention."""
    from tests.test_graph_safety import decode_guarded

    variant, folder, _ = checkpoint
    if variant != "moe":
        pytest.skip("the MoE variant covers every kernel the dense one runs")
    decode_guarded(folder, monkeypatch)


@pytest.mark.slow
def test_padded_decode_batches_leave_real_states_alone(checkpoint) -> None:
    """The CUDA-graph path on the CPU: decode steps run as DecodeGraphs would replay them (batch padded
    to a bucket, padding rows on the scratch slot, metadata from the static buffers), eagerly."""
    from overnight.runner.cuda_graph import DecodeGraphs

    variant, folder, ref = checkpoint
    if variant != "dense":
        pytest.skip("one variant is enough for the padding rows")
    llm = LLM(str(folder), max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, **ENGINE)
    runner = llm.engine.runner  # type: ignore[attr-defined]
    graphs = DecodeGraphs(runner.model, runner.attention_batch, runner.kv_caches, runner.buffers, 8, 256)
    replayed: list[int] = []

    def replay(b: int):
        replayed.append(b)
        return graphs._forward(b)

    graphs.replay = replay  # type: ignore[method-assign]
    runner.graphs = graphs
    check(llm, ref, prompts_of([3, 11, 6, 20, 1], seed=6), 9)  # five decodes in a bucket of 8, then fewer
    assert 8 in replayed and any(b in replayed for b in (1, 2, 4))
