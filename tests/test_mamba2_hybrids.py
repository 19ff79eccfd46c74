"""Tier (c), slow: the Mamba2 hybrids (Granite 4.0 dense, MoE and attention-only; Nemotron-H, and Nemotron 3
with its MoE blocks) against
transformers, fp32 greedy token-exact through the LLM API: prefill chunks cut inside prompts, the Triton
path (interpreter), prefix-cache hits through state snapshots, preemption with a tiny pool, decode steps
without host syncs, decode batches padded as CUDA graphs run them. Nemotron-H runs every test; Granite's
variants share them out (the interpreter is slow). The helpers are test_hybrid_models.py's."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from overnight import LLM
from tests.test_engine_parity import hf_greedy
from tests.test_hybrid_models import (
    ENGINE,
    VOCAB,
    assert_no_rows_held,
    check,
    check_padded_decodes,
    prompts_of,
    run_engine,
)
from tests.tiny_granite import make_granite_checkpoint
from tests.tiny_nemotron_h import make_nemotron_h_checkpoint, make_nemotron_h_moe_checkpoint

pytestmark = pytest.mark.slow  # real engines beside transformers

MAKERS: dict[str, Callable[[Path], Path]] = {
    "granite-dense": lambda d: make_granite_checkpoint(d, "dense"),  # NoPE
    "granite-moe": lambda d: make_granite_checkpoint(d, "moe"),  # RoPE
    "granite-attention-only": lambda d: make_granite_checkpoint(d, "attention-only"),
    "nemotron-h": make_nemotron_h_checkpoint,  # two B/C groups, MLP blocks between the mixers
    "nemotron-3": make_nemotron_h_moe_checkpoint,  # MoE blocks: grouped sigmoid router, relu^2 experts
    # Nemotron 3 Super's latent experts (12 wide in a 32-wide model): the chunked-prefill test only
    "nemotron-3-latent": lambda d: make_nemotron_h_moe_checkpoint(d, moe_latent_size=12),
}
# One request's float32 states: Mamba2 layers x (conv K - 1 rows of x|B|C + SSM heads x d_head x d_state)
STATE_BYTES = {
    "granite-moe": 2 * (4 * 3 * 96 + 4 * 4 * 16 * 8),
    "nemotron-h": 4 * (4 * 3 * 80 + 4 * 4 * 12 * 8),
    "nemotron-3": 2 * (4 * 3 * 80 + 4 * 4 * 12 * 8),
}


@pytest.fixture(scope="module", params=list(MAKERS))
def checkpoint(request, tmp_path_factory):
    import transformers

    folder = MAKERS[request.param](tmp_path_factory.mktemp(request.param))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, ref


def only(model: str, *models: str, why: str) -> None:
    if model not in models:
        pytest.skip(why)


def test_token_exact_with_chunked_prefill(checkpoint) -> None:
    """Chunks of 24 tokens: the longer prompts are cut inside, mixed with other requests' decodes."""
    _, folder, ref = checkpoint
    llm = LLM(str(folder), max_num_batched_tokens=24, max_num_seqs=6, max_model_len=512, **ENGINE)
    check(llm, ref, prompts_of([1, 2, 5, 23, 40, 150], seed=1), 10)
    assert_no_rows_held(llm, 6)


def interpreter_only() -> None:
    """These engines run on CPU tensors with the kernels forced on, which only the Triton interpreter
    (set by conftest.py where there is no GPU) accepts; on a GPU machine a compiled kernel refuses CPU
    pointers. There, tests/test_kernels_mamba2*.py run the same kernels on the device."""
    if torch.cuda.is_available():
        pytest.skip("the Triton interpreter's path over CPU tensors")


def test_token_exact_on_the_triton_path(checkpoint, monkeypatch) -> None:
    """Every layer on its GPU path (the Mamba2 decode step and varlen prefill kernels, conv step with
    its bias, two B/C groups, NoPE attention, the norms), through the Triton interpreter."""
    from overnight.kernels import dispatch

    model, folder, ref = checkpoint
    only(
        model,
        "granite-moe",
        "nemotron-h",
        "nemotron-3",
        why="the interpreter is slow: Granite's MoE variant runs every kernel",
    )
    interpreter_only()
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    llm = LLM(str(folder), max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128, **ENGINE)
    check(llm, ref, prompts_of([1, 9, 30], seed=2), 6)


def test_shared_prefix_hits_through_state_snapshots(checkpoint) -> None:
    model, folder, ref = checkpoint
    only(
        model,
        "granite-dense",
        "nemotron-h",
        "nemotron-3",
        why="snapshots are the mixer's states: one Granite is enough",
    )
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


def test_preemption_restarts_from_a_zero_state(checkpoint) -> None:
    model, folder, ref = checkpoint
    only(model, *STATE_BYTES, why="preemption runs on Granite's MoE variant")
    prompts = prompts_of([5, 13, 40, 57, 9, 30, 21], seed=3)
    block_bytes = 4 * 2 * 2 * 8 * 2 * 4  # 4 tokens x (K, V) x 2 heads of 8 x 2 attention layers x fp32
    llm = LLM(
        str(folder),
        kv_cache_memory_bytes=STATE_BYTES[model] * (7 + 1) + 40 * block_bytes,  # max_num_seqs + 1 slots
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


def test_decode_steps_have_no_host_syncs(checkpoint, monkeypatch) -> None:
    """What CUDA-graph capture forbids (tests/sync_guard.py), in float16 with every layer on its GPU
    path: the Mamba2 decode (conv step with its bias, the SSD step kernel, the per-group norm), the
    fused MoE, NoPE attention, the squared-ReLU MLP."""
    from tests.test_graph_safety import decode_guarded

    model, folder, _ = checkpoint
    only(
        model,
        "granite-moe",
        "nemotron-h",
        "nemotron-3",
        why="Granite's MoE variant covers every kernel the dense one runs",
    )
    interpreter_only()
    decode_guarded(folder, monkeypatch)


def test_padded_decode_batches_leave_real_states_alone(checkpoint) -> None:
    model, folder, ref = checkpoint
    only(model, "granite-dense", "nemotron-h", why="one Granite variant is enough for the padding rows")
    check_padded_decodes(folder, ref)
