"""`overnight budget`: the CPU row on this machine with the default model, and the arithmetic of the pool
on a GPU (a made-up H200's memory) for Qwen3-8B's architecture, without loading any weights."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from overnight.cli import main
from overnight.errors import ModelLoadError
from overnight.loader.resolve import resolve_source
from overnight.options import EngineOptions
from overnight.quant.int_scheme import IntScheme
from overnight.tools.budget import GIB, DeviceMemory, plan_budget, render

# SmolLM2-135M: 30 layers x 2 (K, V) x 3 KV heads x 64 x 4 bytes (fp32 on the CPU)
SMOL_KV_PER_TOKEN = 30 * 2 * 3 * 64 * 4
H200 = DeviceMemory("NVIDIA H200", total_bytes=int(139.8 * GIB), free_bytes=int(139.3 * GIB))


def test_cli_prints_the_cpu_row_and_the_pool(capsys):
    assert main(["budget", "--seq-len", "1024"]) == 0
    out = capsys.readouterr().out
    assert 'row "CPU"' in out
    # the CPU row of the defaults table, each mode (offline and batch share the large budget)
    assert "offline           256                    4096  <- --mode" in out
    assert "server            128                    2048" in out
    assert "batch             256                    4096" in out
    assert f"{SMOL_KV_PER_TOKEN} bytes per token" in out
    blocks = (2 << 30) // (SMOL_KV_PER_TOKEN * 16)  # the CPU default pool: 2 GiB
    assert blocks == 2912
    assert f"2.00 GiB = {blocks} blocks = {blocks * 16} tokens" in out
    assert f"sequences of 1024 tokens that fit: {blocks // 64} (64 blocks each)" in out


def test_cli_json_mode_and_explicit_pool(capsys):
    pool = 100 * 16 * SMOL_KV_PER_TOKEN
    argv = [
        "budget",
        "--json",
        "--mode",
        "server",
        "--kv-cache-memory-bytes",
        str(pool),
        "--seq-len",
        "100",
        "--max-model-len",
        "512",
    ]
    assert main(argv) == 0
    b = json.loads(capsys.readouterr().out)
    assert (b["device"], b["row"], b["mode"]) == ("CPU", "CPU", "server")
    assert (b["max_num_seqs"], b["max_num_batched_tokens"]) == (128, 2048)
    assert b["num_blocks"] == 100 and b["pool_tokens"] == 1600 and not b["capped"]
    assert b["seqs_fit"] == 100 // 7  # 100 tokens take 7 blocks of 16


def test_cli_dummy_preset_needs_no_weights(capsys):
    assert (
        main(
            [
                "budget",
                "--model",
                "qwen3-8b",
                "--load-format",
                "dummy",
                "--max-model-len",
                "8192",
                "--kv-cache-dtype",
                "fp8",
                "--json",
            ]
        )
        == 0
    )
    b = json.loads(capsys.readouterr().out)
    assert b["kv_bytes_per_token"] == 36 * 2 * 8 * 128 * 1


@pytest.fixture(scope="module")
def qwen3_8b():
    return resolve_source("qwen3-8b", "dummy")


def options(**kw) -> EngineOptions:
    return EngineOptions(model="qwen3-8b", load_format="dummy", dtype="bfloat16", **kw)


def test_qwen3_8b_parameter_count(qwen3_8b):
    assert abs(qwen3_8b.arch.num_parameters() - 8.19e9) / 8.19e9 < 0.005


def test_gpu_pool_arithmetic(qwen3_8b):
    b = plan_budget(options(mode="server", max_model_len=4096), qwen3_8b, H200, seq_len=768)
    assert b.row.startswith(">= 70 GiB") and (b.max_num_seqs, b.max_num_batched_tokens) == (1024, 8192)
    assert b.kv_bytes_per_token == 36 * 2 * 8 * 128 * 2
    weights = qwen3_8b.arch.num_parameters() * 2
    expected_budget = (
        int(H200.total_bytes * 0.92) - (H200.total_bytes - H200.free_bytes) - weights - b.activation_bytes
    )
    assert b.budget_bytes == expected_budget and b.weights_bytes == weights
    assert 0 < b.activation_bytes < 8 * GIB
    assert b.num_blocks == expected_budget // (b.kv_bytes_per_token * 16) and not b.capped
    assert b.seqs_fit == b.num_blocks // 48 and b.seqs_at_once == min(b.seqs_fit, 1024)
    assert 100 * GIB < b.pool_bytes < 115 * GIB  # what is left of 0.92 x 139.8 GiB after 15.3 GiB of weights


def test_fp8_halves_the_bytes_per_token(qwen3_8b):
    auto = plan_budget(options(max_model_len=4096), qwen3_8b, H200)
    fp8 = plan_budget(options(max_model_len=4096, kv_cache_dtype="fp8"), qwen3_8b, H200)
    assert fp8.kv_bytes_per_token * 2 == auto.kv_bytes_per_token
    assert (auto.block_size, fp8.block_size) == (16, 64)  # an FP8 cache's pages are 64 tokens
    assert fp8.num_blocks == fp8.budget_bytes // (fp8.kv_bytes_per_token * 64)
    assert abs(fp8.pool_tokens - 2 * auto.pool_tokens) <= 64  # rounding down to whole blocks


def test_batch_mode_gets_a_large_budget_and_the_cap_applies(qwen3_8b):
    batch = plan_budget(options(mode="batch", max_model_len=4096), qwen3_8b, H200)
    # twice the offline class's tokens a step on a 70+ GiB GPU (measured +6% on an H200)
    assert (batch.max_num_seqs, batch.max_num_batched_tokens) == (1024, 32768)
    assert batch.modes["offline"] == (1024, 16384)
    assert batch.modes["server"] == (1024, 8192)
    capped = plan_budget(options(max_model_len=1024, max_num_seqs=2), qwen3_8b, H200)
    assert capped.capped and capped.num_blocks == 2 * (2 * 1024 // 16)


def test_no_room_is_reported_not_raised(qwen3_8b):
    small = DeviceMemory("tiny", total_bytes=16 * GIB, free_bytes=16 * GIB)
    b = plan_budget(options(max_model_len=4096), qwen3_8b, small)
    assert b.num_blocks == 0 and b.seqs_fit == 0
    assert "weights take 15.26 GiB" in b.pool_source  # the engine's own message: what does not fit


def test_fp8_moe_pool_counts_fp8_experts():
    """Qwen3-30B-A3B with FP8 weights: the pool is sized after the experts are quantized (they hold
    ~27 GiB fewer than in bf16), so it grows by about that much."""
    from dataclasses import replace

    from overnight.quant.scheme import QuantScheme

    moe = resolve_source("qwen3-30b-a3b", "dummy")
    opts = EngineOptions(model="qwen3-30b-a3b", load_format="dummy", dtype="bfloat16", max_model_len=4096)
    bf16 = plan_budget(opts, moe, H200)
    fp8 = plan_budget(replace(opts, quantization="fp8"), replace(moe, quantization=QuantScheme()), H200)
    assert 54 * GIB < bf16.weights_bytes < 58 * GIB and 27 * GIB < fp8.weights_bytes < 31 * GIB
    assert 24 * GIB < fp8.pool_bytes - bf16.pool_bytes < 29 * GIB


def test_sliding_windows_count_only_their_window(qwen3_8b):
    """Qwen3-8B's shapes with Gemma 3's layer pattern (5 windowed : 1 full, W = 1024) at 32K: a
    sequence holds 6 layers x 32K + 30 layers x (1024 + chunk) tokens, and several times as many fit."""
    from dataclasses import replace

    from overnight.tools.budget import render

    kinds = tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(36))
    gemma_like = replace(qwen3_8b, arch=replace(qwen3_8b.arch, layer_types=kinds, sliding_window=1024))
    opts = options(max_model_len=32768)
    full = plan_budget(opts, qwen3_8b, H200)
    win = plan_budget(opts, gemma_like, H200)
    chunk = win.max_num_batched_tokens
    per_layer = 2 * 8 * 128 * 2
    assert win.kv_bytes_per_token == full.kv_bytes_per_token == 36 * per_layer
    assert (win.kv_layers, win.windowed_layers, win.windows) == (36, 30, (1024,))
    assert win.seq_kv_bytes == (6 * 32768 + 30 * (1024 + chunk)) * per_layer
    assert full.seq_kv_bytes == 32768 * 36 * per_layer
    # Blocks of 16 tokens x one layer in each of 6 tensors, groups of 6 layers: 1 full (2048 blocks at
    # 32K) and 5 windowed (cdiv(1023 + 1, 16) + 1 blocks between chunks; one step's chunk more, once).
    assert win.block_bytes == 16 * 6 * per_layer
    assert win.seq_blocks == 2048 + 5 * 65
    chunk_blocks = 5 * (-(-(1023 + chunk) // 16) + 1) - 5 * 65
    assert win.seqs_fit == (win.num_blocks - chunk_blocks) // win.seq_blocks
    assert win.num_blocks == win.budget_bytes // win.block_bytes
    assert win.seqs_fit >= 3 * full.seqs_fit > 0
    text = render(win, "gemma-like", gemma_like.arch, "bfloat16")
    assert "sliding windows: 30 of 36 layers keep only their last 1024 tokens" in text
    assert f"sequences of 32768 tokens that fit: {win.seqs_fit} ({win.seq_blocks} blocks each)" in text


def test_gemma4_windows_count_with_full_blocks_of_twice_the_tokens():
    """Gemma-4-31B at 32K: its windowed layers (16 KV heads x 256) give blocks back although its full
    layers (4 x 512) differ; a full layer needs half a slot per token, so a full block of 10 layers
    holds 32 tokens, not 16 with half of it padding (engine/kv_groups.py: block scales)."""
    from dataclasses import replace

    from overnight.engine.kv_groups import KVCacheLayout
    from overnight.tools.budget import render

    source = resolve_source("gemma-4-31b", "dummy")
    opts = EngineOptions(model="gemma-4-31b", load_format="dummy", dtype="bfloat16", max_model_len=32768)
    b = plan_budget(opts, source, H200)
    assert (b.kv_layers, b.windowed_layers, b.windows) == (60, 50, (1024,))
    assert b.full_block_padding == 0.0 and b.full_block_scale == 2
    assert b.block_bytes == 16 * 10 * 2 * 16 * 256 * 2  # 16 tokens x 10 tensors x K/V x 4096 x bf16
    one_group = KVCacheLayout.uniform(source.arch)  # one tensor per layer, nothing given back
    per_layer_seqs = b.budget_bytes // (2048 * 16 * one_group.token_elems * 2)
    assert b.seqs_fit >= 4 * per_layer_seqs > 0, (b.seqs_fit, per_layer_seqs)
    # A sequence: 1024 blocks of the full group + 5 x 65 windowed, against 2048 + 5 x 65 with the full
    # blocks padded (1349 against 2373 blocks: 15 sequences of 32K fit the H200's pool, not 8).
    layout = KVCacheLayout.from_arch(source.arch, 32768)
    padded = replace(layout, block_scales=(1,) * layout.num_groups)
    assert b.seq_blocks == layout.blocks_per_sequence(32768, 1, 16) == 1024 + 5 * 65
    assert padded.blocks_per_sequence(32768, 1, 16) == 2048 + 5 * 65
    assert b.seqs_fit >= 15  # one step's chunk of 16K in the windowed groups set aside
    assert (
        "a full-attention layer needs 1/2 of a windowed layer's bytes per token, so its blocks hold 32"
        in (render(b, "gemma-4-31b", source.arch, "bfloat16"))
    )


def test_gemma3_27b_groups_of_five_and_their_empty_slots():
    """Gemma-3-27B (10 full, 52 windowed): 13 groups of 5 layers, 3 of 65 slots empty, said and counted;
    Gemma-4-31B's groups of 10 are exact, so no such line."""
    from overnight.tools.budget import render

    source = resolve_source("gemma-3-27b", "dummy")
    opts = EngineOptions(model="gemma-3-27b", load_format="dummy", dtype="bfloat16", max_model_len=4096)
    b = plan_budget(opts, source, H200)
    assert (b.num_groups, b.group_layers, b.empty_slots) == (13, 5, (3, 65))
    assert b.block_bytes == 16 * 5 * 2 * 16 * 128 * 2  # 16 tokens x 5 tensors x K/V x 2048 x bf16
    # A sequence of 4,096: 256 blocks in each full group, 65 in each windowed one (its window + 1).
    assert b.seq_blocks == 2 * 256 + 11 * 65 and 0 < b.seqs_fit <= b.num_blocks // b.seq_blocks
    text = render(b, "gemma-3-27b", source.arch, "bfloat16")
    assert (
        "13 KV cache groups of 5 layers, one block table each: 3 of 65 cache slots stay empty (4.6%" in text
    )
    g4 = resolve_source("gemma-4-31b", "dummy")
    b4 = plan_budget(replace(opts, model="gemma-4-31b"), g4, H200)
    assert b4.empty_slots == (0, 60) and "cache slots stay empty" not in render(b4, "g4", g4.arch, "bfloat16")


def test_llama4_chunked_layers_count_only_their_chunk():
    """Llama-4-Scout (FP8 weights) on an H200 at 128K: its 36 chunked layers (C = 8192) hold only the
    current attention chunk, so a sequence holds 12 layers x 128K + 36 x 8K tokens (groups of 12 layers:
    8192 blocks of the global group + 3 x 512), and two sequences of 128K fit; keeping every block of
    every layer, as before, not one does (the pool holds 100K tokens of all 48 layers)."""
    from overnight.engine.kv_groups import KVCacheLayout

    source = resolve_source("llama-4-scout-17b-16e", "dummy", quantization="fp8")
    opts = EngineOptions(
        model="llama-4-scout-17b-16e", load_format="dummy", dtype="bfloat16", quantization="fp8",
        max_model_len=131072,
    )  # fmt: skip
    b = plan_budget(opts, source, H200)
    kept = replace(source, arch=replace(source.arch, layer_types=(), attention_chunk_size=None))
    every = plan_budget(opts, kept, H200)
    per_layer = 2 * 8 * 128 * 2
    assert (b.kv_layers, b.chunked_layers, b.chunks, b.windowed_layers) == (48, 36, (8192,), 0)
    assert 4 * b.block_bytes == every.block_bytes == 16 * 48 * per_layer  # a block: 12 layers, or 48
    assert b.budget_bytes == every.budget_bytes
    assert b.seq_blocks == 8192 + 3 * 512 and every.seq_blocks == 8192
    chunk = b.max_num_batched_tokens  # one step's chunk in the chunked groups, set aside once
    chunk_blocks = 3 * (-(-(8191 + chunk) // 16)) - 3 * 512
    assert b.seqs_fit == (b.num_blocks - chunk_blocks) // b.seq_blocks == 2
    assert every.seqs_fit == every.num_blocks // 8192 == 0 and every.pool_tokens < 131072
    assert b.seq_kv_bytes == (12 * 131072 + 36 * (8192 + chunk)) * per_layer
    text = render(b, "llama-4-scout-17b-16e", source.arch, "bfloat16")
    assert "chunked attention: 36 of 48 layers keep only the current attention chunk of 8192 tokens" in text
    assert "sequences of 131072 tokens that fit: 2 (9728 blocks each)" in text
    layout = KVCacheLayout.from_arch(source.arch, 131072)
    assert layout.chunks == (None,) + (8192,) * 3 and layout.num_tensors == 12


def test_cli_counts_the_windows_of_a_checkpoint(tmp_path, capsys):
    """`overnight budget --model <folder>` on a Gemma-3-shaped checkpoint (5 windowed : 1 full)."""
    import torch
    from safetensors.torch import save_file

    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    config = dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=384, hidden_size=64, intermediate_size=128,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, use_sliding_window=True, sliding_window=32, layer_types=kinds,
    )  # fmt: skip
    folder = tmp_path / "gemma-shaped"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"unused": torch.zeros(1)}, folder / "model.safetensors")  # the budget reads no weight
    pool = 1 << 20
    argv = ["budget", "--model", str(folder), "--json", "--seq-len", "500", "--max-model-len", "512"]
    assert main(argv + ["--kv-cache-memory-bytes", str(pool), "--max-num-batched-tokens", "64"]) == 0
    b = json.loads(capsys.readouterr().out)
    per_layer = 2 * 2 * 16 * 4  # K/V x 2 heads x 16 x fp32
    assert (b["kv_layers"], b["windowed_layers"], b["windows"]) == (6, 5, [32])
    assert b["block_bytes"] == 16 * per_layer and b["num_blocks"] == pool // (16 * per_layer)
    assert b["seq_blocks"] == 32 + 5 * 3  # 500 tokens in the full layer; cdiv(31 + 1, 16) + 1 per window
    assert b["seq_kv_bytes"] == (500 + 5 * (32 + 64)) * per_layer
    chunk_blocks = 5 * (-(-(31 + 64) // 16) + 1) - 5 * 3
    assert b["seqs_fit"] == (b["num_blocks"] - chunk_blocks) // b["seq_blocks"]


# -- tensor parallelism: one GPU's share ---------------------------------------------------------------


def test_tensor_parallel_budget_is_one_gpus_share(qwen3_8b):
    """Qwen3-8B (32 q heads, 8 KV heads) over 1, 2, 4 GPUs and 16 (more GPUs than KV heads: each
    KV head replicated over 2 GPUs): weights and KV per token per GPU about halve with each doubling,
    so more sequences fit on each GPU."""
    b = {
        tp: plan_budget(options(max_model_len=4096, tensor_parallel_size=tp), qwen3_8b, H200, seq_len=4096)
        for tp in (1, 2, 4, 8, 16)
    }
    whole = qwen3_8b.arch.num_parameters() * 2
    assert b[1].weights_bytes == whole and b[1].tensor_parallel_size == 1
    for tp in (2, 4, 8):
        # more than whole / tp (norms are replicated), less than 1% more
        assert whole / tp < b[tp].weights_bytes < 1.01 * whole / tp
        assert b[tp].kv_bytes_per_token * tp == b[1].kv_bytes_per_token == 36 * 2 * 8 * 128 * 2
        assert b[tp].seqs_fit >= 2 * b[tp // 2].seqs_fit > 0
        assert b[tp].num_blocks == b[tp].budget_bytes // (b[tp].kv_bytes_per_token * 16)
    # 16 GPUs, 8 KV heads: one head per GPU, as at 8; the K/V rows of that head held twice
    assert b[16].kv_bytes_per_token == b[8].kv_bytes_per_token
    kv_rows = 36 * 2 * 128 * 4096 * 2  # k_proj and v_proj rows of one head, every layer
    assert whole / 16 + kv_rows / 2 < b[16].weights_bytes < 1.01 * whole / 16 + kv_rows
    text = render(b[2], "qwen3-8b", qwen3_8b.arch, "bfloat16")
    assert "on each of 2 GPUs" in text and "(36 layers x 2 x 4 heads x 128) x 2 B" in text


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3.5-9b", "gpt-oss-20b"])
def test_tensor_parallel_weights_are_what_a_rank_holds(name):
    """The per-GPU weights equal the parameters apply_tp leaves rank 0 (a meta model: no memory) --
    tied vocab-parallel embeddings, Gated DeltaNet layers, MXFP4 experts -- and the state pool of a
    hybrid holds the rank's linear-attention heads only."""
    import torch

    from overnight.loader.model_loader import build_model
    from overnight.parallel.tp import apply_tp

    source = resolve_source(name, "dummy")
    opts = EngineOptions(model=name, load_format="dummy", dtype="bfloat16", max_model_len=4096)
    one = plan_budget(opts, source, H200)
    for tp in (2, 4):
        b = plan_budget(replace(opts, tensor_parallel_size=tp), source, H200)
        model = apply_tp(build_model(source, torch.bfloat16, "meta", runs_on="cpu"), 0, tp)
        held = {id(p): p.numel() * p.element_size() for p in model.parameters()}
        assert b.weights_bytes == sum(held.values())
        assert b.state_bytes_per_seq * tp == one.state_bytes_per_seq  # 0 without linear layers


def test_tensor_parallel_refused_by_the_engine_check(qwen3_8b, capsys):
    """What tensor parallelism refuses, the budget refuses, with the same sentence."""
    with pytest.raises(
        ModelLoadError, match="tensor_parallel_size 3 does not divide .*num_attention_heads 32"
    ):
        plan_budget(options(tensor_parallel_size=3), qwen3_8b, H200)
    # an integer checkpoint whose packed layers cannot be split (parallel/tp_int.py), on a GPU
    gptq = IntScheme("gptq", bits=4, group_size=128, symmetric=True, act_order=True)
    with pytest.raises(ModelLoadError, match="act-order"):
        plan_budget(options(tensor_parallel_size=2), replace(qwen3_8b, quantization=gptq), H200)
    assert main(["budget", "--model", "qwen3-8b", "--load-format", "dummy", "-tp", "3"]) == 2
    assert "overnight budget: tensor_parallel_size 3 does not divide" in capsys.readouterr().err


def test_tensor_parallel_takes_the_tightest_gpu(monkeypatch):
    import torch

    from overnight.errors import ConfigError
    from overnight.tools.budget import device_memory

    free = {0: 100 * GIB, 1: 60 * GIB, 2: 90 * GIB}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free[d.index], 140 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "H200")
    assert device_memory(torch.device("cuda", 0), 2) == DeviceMemory("H200", 140 * GIB, 60 * GIB)
    assert device_memory(torch.device("cuda", 2)) == DeviceMemory("H200", 140 * GIB, 90 * GIB)
    with pytest.raises(ConfigError, match="tensor_parallel_size 2 needs GPUs 2..3, but this machine has 3"):
        device_memory(torch.device("cuda", 2), 2)


def test_tensor_parallel_packed_int_experts_are_one_gpus_share(monkeypatch):
    """Qwen3-30B-A3B in AWQ (groups of 128, zero points) over 2 GPUs: the packed experts (768 wide, 384
    a GPU: 3 groups) are split, not refused, and the per-GPU weights are what apply_tp leaves rank 0
    of a meta model: packed codes, scales and zero points, experts included. 4 GPUs would give each
    192 columns, not whole groups: refused by name."""
    import torch

    from overnight.loader.model_loader import build_model
    from overnight.parallel.tp import apply_tp
    from overnight.quant import apply
    from overnight.quant.int_moe import IntExperts

    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)  # the meta model built in the GPU's layout
    awq = IntScheme("awq", bits=4, group_size=128, symmetric=False)
    source = replace(resolve_source("qwen3-30b-a3b", "dummy"), quantization=awq)
    opts = EngineOptions(model="qwen3-30b-a3b", load_format="dummy", dtype="bfloat16", max_model_len=4096)
    one = plan_budget(opts, source, H200)
    two = plan_budget(replace(opts, tensor_parallel_size=2), source, H200)
    model = apply_tp(build_model(source, torch.bfloat16, "meta", runs_on="cpu"), 0, 2)
    experts = [m for m in model.modules() if isinstance(m, IntExperts)]
    assert len(experts) == 48 and experts[0].intermediate_size == 384
    held = [*model.parameters(), *(b for m in experts for b in m.buffers())]
    assert two.weights_bytes == sum(t.numel() * t.element_size() for t in held)
    assert one.weights_bytes / 2 < two.weights_bytes < 1.01 * one.weights_bytes / 2
    with pytest.raises(ModelLoadError, match="192 columns of the experts' intermediate size 768"):
        plan_budget(replace(opts, tensor_parallel_size=4), source, H200)


@pytest.mark.parametrize("name", ["qwen3.5-9b", "qwen3.5-35b-a3b"])
def test_packed_int_hybrid_weights_are_what_a_gpu_holds(name, monkeypatch):
    """Qwen3.5 (dense, and MoE with a shared expert) in AWQ, on 1 and 2 GPUs: the weights counted are
    exactly what the meta model holds, packed Gated DeltaNet projections, gated attention, shared
    expert and experts included (apply_tp's rank 0 on 2)."""
    import torch

    from overnight.loader.model_loader import build_model
    from overnight.parallel.tp import apply_tp
    from overnight.quant import apply
    from overnight.quant.int_moe import IntExperts

    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    awq = IntScheme("awq", bits=4, group_size=128, symmetric=False)
    source = replace(resolve_source(name, "dummy"), quantization=awq)
    opts = EngineOptions(model=name, load_format="dummy", dtype="bfloat16", max_model_len=4096)
    for tp in (1, 2):
        b = plan_budget(replace(opts, tensor_parallel_size=tp), source, H200)
        model = build_model(source, torch.bfloat16, "meta", runs_on="cpu")
        model = apply_tp(model, 0, tp) if tp > 1 else model
        experts = [m for m in model.modules() if isinstance(m, IntExperts)]
        assert bool(experts) == (name == "qwen3.5-35b-a3b")
        held = [*model.parameters(), *(t for m in experts for t in m.buffers())]
        assert b.weights_bytes == sum(t.numel() * t.element_size() for t in held)


def test_packed_int4_prints_its_decode_row_caps(qwen3_8b):
    """Qwen3-32B-AWQ packed on an H100: the caps the engine would schedule with, and what they do to
    the sequences at once (scheduler.py _decode_rows); a bf16 model has none."""
    h100 = DeviceMemory("NVIDIA H100 80GB HBM3", total_bytes=int(79.19 * GIB), free_bytes=int(78.7 * GIB))
    source = resolve_source("qwen3-32b-awq", "dummy")
    opts = EngineOptions(model="qwen3-32b-awq", load_format="dummy", dtype="bfloat16", mode="batch")
    b = plan_budget(opts, source, h100, seq_len=700)
    assert b.decode_row_caps == ((64, 94), (128, 150), (192, 225), (256, 291))
    assert 256 < b.seqs_at_once <= 291
    text = render(b, source.served_name, source.arch, "bfloat16")
    assert "257-291 -> 256" in text and f"at {b.seqs_at_once} at once, 256 decode a step" in text
    off = plan_budget(replace(opts, decode_row_caps="off"), source, h100, seq_len=700)
    assert off.decode_row_caps == () and "decode row caps" not in render(off, "m", source.arch, "bf16")
    assert plan_budget(options(), qwen3_8b, H200).decode_row_caps == ()
