"""Tier (a) for hybrid linear-attention models, in seconds: linear layers own no KV cache (layout, KV
bytes, the pool plan sets the state pool aside), the scheduler's state checkpoints and snapshots
(chunks clipped to block boundaries, saves pending until their step ran, hits cut back to a saved
state, LRU eviction), the config reader, the parameter count, and the dummy presets' shapes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from overnight.config import CacheConfig, SchedulerConfig
from overnight.engine.kv_cache_manager import KVCacheManager
from overnight.engine.kv_groups import KVCacheLayout
from overnight.engine.pool_plan import PoolMemoryError, reserve_state_bytes, state_slots, state_snapshots
from overnight.engine.request import Request
from overnight.engine.scheduler import Scheduler
from overnight.engine.state_snapshots import StateSnapshots
from overnight.engine.step_io import ModelRunnerOutput
from overnight.errors import ModelLoadError
from overnight.loader.fit import kv_bytes_per_sequence
from overnight.loader.model_loader import build_model
from overnight.loader.resolve import PRESETS_DIR, resolve_source
from overnight.models.registry import arch_from_hf_config
from overnight.sampling_params import SamplingParams
from tests.tiny_hybrid import VARIANTS, make_hybrid_model

B = 4  # tokens per block


def tiny_arch(variant: str = "qwen3_5"):
    model = make_hybrid_model(variant)
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    return arch_from_hf_config(cfg), model


def test_linear_layers_own_no_kv_cache():
    arch, _ = tiny_arch()
    assert arch.layer_types == ("linear_attention", "full_attention") * 2
    layout = KVCacheLayout.from_arch(arch, 512)
    assert [g.layers for g in layout.groups] == [(1, 3)]
    assert layout.layer_tensor == (-1, 0, -1, 1) and layout.is_uniform
    assert layout.token_elems == 2 * 2 * 1 * 16  # two full layers x (K, V) x 1 head x 16
    assert arch.kv_bytes_per_token(4) == 4 * layout.token_elems
    assert kv_bytes_per_sequence(arch, 100, 16, 4) == 100 * 4 * layout.token_elems
    # conv: K-1 = 3 inputs of 2 x 2 x 8 + 4 x 6 channels; delta rule: 4 heads x 8 x 6; two layers
    assert arch.linear_state_shapes() == ((3, 56), (4, 8, 6))
    assert arch.linear_state_bytes() == 2 * 4 * (3 * 56 + 4 * 8 * 6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_parameter_count_matches_transformers(variant):
    arch, model = tiny_arch(variant)
    # The ConditionalGeneration variants load their vision tower too (models/qwen3_5_vl.py).
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())


def test_pool_plan_sets_the_state_pool_aside():
    arch, _ = tiny_arch()
    sched = SchedulerConfig(max_num_seqs=8)
    cache = CacheConfig(enable_prefix_caching=True)
    slots, snaps = state_slots(sched), state_snapshots(sched, cache)
    assert (slots, snaps) == (9, 4)
    assert state_snapshots(sched, CacheConfig(enable_prefix_caching=False)) == 0
    per = arch.linear_state_bytes()
    assert reserve_state_bytes(10**6, arch, sched, cache) == 10**6 - per * (slots + snaps)
    with pytest.raises(PoolMemoryError, match="linear-attention states of 8 requests"):
        reserve_state_bytes(per * 10, arch, sched, cache)
    dense = arch_from_hf_config(json.load(open(os.path.join(PRESETS_DIR, "qwen3-8b.json"))))
    assert reserve_state_bytes(1000, dense, sched, cache) == 1000


def test_config_errors_name_the_problem():
    _, model = tiny_arch()
    cfg = model.config.to_dict()
    cfg["architectures"] = ["Qwen3_5ForCausalLM"]
    with pytest.raises(ModelLoadError, match="layer_types must name 4 layers"):
        arch_from_hf_config({**cfg, "layer_types": ["linear_attention"] * 3})
    with pytest.raises(ModelLoadError, match="multiple of key heads"):
        arch_from_hf_config({**cfg, "linear_num_value_heads": 3})
    with pytest.raises(ModelLoadError, match="unsupported RoPE type"):
        arch_from_hf_config({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    bare = {
        k: v for k, v in cfg.items() if k not in ("layer_types", "partial_rotary_factor", "rope_parameters")
    }
    arch = arch_from_hf_config({**bare, "full_attention_interval": 2})
    assert arch.layer_types == ("linear_attention", "full_attention") * 2
    assert arch.hybrid_rotary_dim == 4  # the default partial rotary factor, 0.25 of 16


@pytest.mark.parametrize(
    ("name", "linear", "kv_per_token", "billions"),
    [("qwen3.5-9b", 24, 8 * 2 * 4 * 256 * 2, 8.95), ("qwen3.5-35b-a3b", 30, 10 * 2 * 2 * 256 * 2, 34.66)],
)
def test_dummy_presets_have_the_published_shapes(name, linear, kv_per_token, billions):
    source = resolve_source(name, load_format="dummy")
    arch = source.arch
    assert arch.num_linear_layers == linear and arch.head_dim == 256 and arch.hybrid_rotary_dim == 64
    assert arch.kv_bytes_per_token(2) == kv_per_token
    assert arch.num_parameters() / 1e9 == pytest.approx(billions, abs=0.05)
    model = build_model(source, torch.bfloat16, "meta")  # shapes only
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()


# -- checkpoints and snapshots in the scheduler ------------------------------------------------------


def request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), 0, frozenset(), 10_000, 0.0)


def make_scheduler(chunk: int = 64, snapshots: int = 4) -> Scheduler:
    kv = KVCacheManager(200, B, enable_caching=True)
    # Greedy admission: these requests may run to 10,000 tokens, more than the pool; planned admission
    # would start one at a time.
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=chunk, max_model_len=512, admission="greedy"
    )
    return Scheduler(config, kv, snapshots=StateSnapshots(snapshots, kv))


def step(sched: Scheduler):
    out = sched.schedule()
    sampled = [r for r in out.num_scheduled_tokens if sched.requests[r].num_pending]
    sched.update(out, ModelRunnerOutput(sampled, [7] * len(sampled)))
    return out


def test_chunks_end_at_the_last_boundary_and_the_state_is_saved_there():
    sched = make_scheduler(chunk=64)
    sched.add(request("a", list(range(3, 53))))  # 50 tokens: last boundary <= 49 is 48
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 48} and out.state_saves == [("a", 0)]
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 2} and out.state_saves == []
    # the same prompt again: a hit of 48 tokens, restored from that snapshot
    sched.add(request("b", list(range(3, 53))))
    out = step(sched)
    (new,) = out.new_reqs
    assert (new.num_computed_tokens, new.restore_snapshot) == (48, 0)
    assert out.num_scheduled_tokens["b"] == 2


def test_a_snapshot_serves_no_hit_before_its_step_ran_and_a_junction_is_saved():
    sched = make_scheduler(chunk=40)
    shared = list(range(3, 43))  # 40 shared tokens, then each prompt its own
    sched.add(request("a", shared + [50, 51, 52, 53, 54]))
    out = sched.schedule()  # "a" computes [0, 40): no checkpoint there yet (its last is 44)
    assert out.num_scheduled_tokens == {"a": 40} and out.state_saves == []
    sched.update(out, ModelRunnerOutput([], []))
    sched.add(request("b", shared + [60, 61, 62]))
    out = sched.schedule()  # "a" runs [40, 44) and saves; "b" finds the KV of 10 blocks, no state
    assert out.num_scheduled_tokens["a"] == 4 and out.state_saves[0] == ("a", 0)
    (new,) = out.new_reqs
    assert new.num_computed_tokens == 0 and new.restore_snapshot is None
    # "b" stops at the junction (40) and saves the shared prefix's state
    assert out.num_scheduled_tokens["b"] == 36 and out.state_saves[1:] == []
    sched.update(out, ModelRunnerOutput([], []))
    out = sched.schedule()
    assert out.num_scheduled_tokens["b"] == 4 and out.state_saves == [("b", 1)]
    sched.add(request("c", shared + [70, 71]))
    # "c" is admitted in the same step as that save: the snapshot is still pending, so no hit
    assert out.new_reqs == [] or out.new_reqs[0].restore_snapshot is None
    sched.update(out, ModelRunnerOutput([], []))
    sched.add(request("d", shared + [80, 81, 82, 83]))
    out = step(sched)
    (new,) = [n for n in out.new_reqs if n.req_id == "d"]
    assert (new.num_computed_tokens, new.restore_snapshot) == (40, 1)


def test_snapshots_are_evicted_least_recently_used_first():
    kv = KVCacheManager(200, B, enable_caching=True)
    snaps = StateSnapshots(2, kv)
    reqs = [request(str(i), [i + 3] * 9) for i in range(3)]  # last boundary 8 each
    ids = [snaps.save_after(r, 0, 8) for r in reqs]
    assert ids == [0, 1, 0]  # the third save reuses the oldest id
    snaps.commit([(r.req_id, i) for r, i in zip(reqs, ids)])
    assert snaps.num_cached == 2
    assert snaps.save_after(reqs[2], 0, 8) is None  # already kept


def test_budget_on_an_h200_sets_the_state_pool_aside():
    from overnight.options import EngineOptions
    from overnight.tools.budget import GIB, DeviceMemory, plan_budget

    h200 = DeviceMemory("NVIDIA H200", total_bytes=int(139.8 * GIB), free_bytes=int(139.3 * GIB))
    source = resolve_source("qwen3.5-9b", load_format="dummy")
    opts = EngineOptions(model="qwen3.5-9b", load_format="dummy", max_model_len=32768, max_num_seqs=64)
    b = plan_budget(opts, source, h200, seq_len=8192)
    per = source.arch.linear_state_bytes()
    assert b.state_bytes_per_seq == per == 24 * 4 * (3 * 8192 + 32 * 128 * 128)  # 50.25 MiB
    assert b.state_pool_bytes == per * (64 + 1 + 16)  # slots + scratch + snapshots
    # the state pool comes out of the memory given to caches, the KV pool gets the rest
    given = EngineOptions(
        model="qwen3.5-9b",
        load_format="dummy",
        max_model_len=32768,
        max_num_seqs=64,
        kv_cache_memory_bytes=40 << 30,
    )
    fixed = plan_budget(given, source, h200, seq_len=8192)
    assert fixed.budget_bytes == (40 << 30) - b.state_pool_bytes
    assert fixed.pool_bytes <= fixed.budget_bytes
    assert b.kv_bytes_per_token == 8 * 2 * 4 * 256 * 2  # the 8 full-attention layers only, bf16


def test_tensor_parallelism_checks_the_linear_heads():
    from dataclasses import replace

    from overnight.build import check_parallel
    from overnight.errors import ModelLoadError
    from overnight.options import EngineOptions

    source = resolve_source("qwen3.5-35b-a3b", load_format="dummy")
    opts = EngineOptions(model="qwen3.5-35b-a3b", load_format="dummy", tensor_parallel_size=2)
    check_parallel(opts, source)  # 16 key heads, 32 value heads: 8 and 16 a rank
    odd = replace(source, arch=replace(source.arch, linear_num_key_heads=3, linear_num_value_heads=6))
    with pytest.raises(ModelLoadError, match="does not divide the model's linear_num_key_heads 3"):
        check_parallel(opts, odd)


def test_fp8_weights_are_configured():
    from overnight.build import build_config
    from overnight.options import EngineOptions

    opts = EngineOptions(model="qwen3.5-9b", load_format="dummy", quantization="fp8")
    source = resolve_source("qwen3.5-9b", load_format="dummy", quantization="fp8")
    assert build_config(opts, source, torch.device("cpu"), None).model.quantization == "fp8"
