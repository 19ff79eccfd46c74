"""--decode-overlap (runner/decode_overlap.py): a decode bucket as two half-batch graphs.

On the CPU: the halves' inputs (decode_overlap.half_inputs over StepBuffers that a real
StepBuffers.build of each decode step filled) run eagerly through the model give the full batch's
hidden states, and the engine's greedy tokens through the halves equal transformers', with one KV cache
group and with several (sliding-window layers, so each group's slot run of stride b is read at the
half's offset); half 1's Triton backend has workspaces of its own; capture and replay, with torch.cuda
faked, give each half its own pool and stream and order the streams' waits; the option is refused, by
name, wherever it cannot run. On a GPU: greedy tokens with and without the option are equal for 300
concurrent requests (the halves' graphs replayed on two streams).
"""

from __future__ import annotations

import gc
import random
from dataclasses import replace

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.attention.torch_backend import TorchAttentionBackend
from overnight.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
)
from overnight.errors import ConfigError
from overnight.loader.resolve import resolve_source
from overnight.runner.cuda_graph import DecodeGraphs
from overnight.runner.decode_overlap import SPLIT_FROM, check_decode_overlap, half_inputs
from overnight.runner.inputs import StepBuffers
from tests.test_engine_parity import hf_greedy
from tests.tiny_models import load_reference, make_tiny_checkpoint

ENGINE = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4)
SHAPE = ["sliding_attention"] * 3 + ["full_attention"]  # several KV cache groups (engine/kv_groups.py)
WINDOWED = dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, layer_types=SHAPE)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_half_inputs_are_views_of_each_half_s_rows() -> None:
    """Half 1 of a step of b rows reads rows [b // 2, b) of every buffer and group g's slots at
    g * b + row (StepBuffers packs group runs with stride b); half 0 the step's own query starts."""
    b, groups = 10, 2
    buf = StepBuffers(16, 16, 3, 4, torch.device("cpu"), num_groups=groups)
    buf.ids[:b] = torch.arange(100, 100 + b)
    buf.pos[:b] = torch.arange(200, 200 + b)
    buf.slots[: groups * b] = torch.arange(groups * b)
    buf.seq_lens[:b] = torch.arange(1, b + 1)
    buf.tables[:, :b] = torch.arange(groups * b * 3, dtype=torch.int32).view(groups, b, 3)
    buf.qsl[: b + 1] = torch.arange(b + 1)
    arange = torch.arange(b + 1, dtype=torch.int32)
    first, second = (half_inputs(buf, b, half, 64, arange) for half in (0, 1))
    assert (first.rows, second.rows) == (slice(0, 5), slice(5, 10))
    assert second.input_ids.tolist() == list(range(105, 110))
    assert second.positions.tolist() == list(range(205, 210))
    for g, meta in enumerate(second.group_metas):
        assert meta.slot_mapping.tolist() == [g * b + r for r in range(5, 10)]
        assert torch.equal(meta.block_tables, buf.tables[g, 5:10])
        assert meta.seq_lens.tolist() == list(range(6, 11))
        assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5]
        assert (meta.num_reqs, meta.num_decodes, meta.num_tokens, meta.max_seq_len) == (5, 5, 5, 64)
    assert first.meta.query_start_loc.data_ptr() == buf.qsl.data_ptr()
    assert first.group_metas[1].slot_mapping.tolist() == list(range(10, 15))
    assert second.meta is second.group_metas[0]
    # An odd bucket (max_num_seqs is one): half 1 takes the extra row.
    odd = half_inputs(buf, 9, 1, 64, arange)
    assert odd.rows == slice(4, 9) and odd.group_metas[1].slot_mapping.tolist() == list(range(13, 18))


def test_triton_twin_splits_alike_into_a_workspace_of_its_own() -> None:
    """Half 1's backend (AttentionBackend.twin): the same splits and outputs, none of the split-decode
    scratch shared. A half of 128 rows of a layer with 2 KV heads splits (256 programs, under 4 per SM
    of an H100), so the halves would otherwise race on one workspace."""
    from overnight.attention.triton_backend import TritonAttentionBackend
    from overnight.kernels.paged_decode import DecodeConfig
    from tests.kernel_helpers import DEVICE, make_batch

    backend = TritonAttentionBackend(
        4, 2, 16, max_num_seqs=8, max_model_len=4096, device=DEVICE, decode_config=DecodeConfig(block_n=16)
    )
    twin = backend.twin()
    assert backend.num_splits(128) > 1 and twin.num_splits(2) == backend.num_splits(2) > 1
    for a, b in (
        (backend.workspace, twin.workspace),
        (backend.workspace_for(8, 32), twin.workspace_for(8, 32)),
    ):
        assert a is not b and a.part_out.data_ptr() != b.part_out.data_ptr()
        assert a.part_lse.data_ptr() != b.part_lse.data_ptr() and a.max_rows == b.max_rows
    meta, q, cache = make_batch([1, 1], [37, 20], 2, 4, 2, 16, 16, torch.float32, seed=4)
    torch.testing.assert_close(
        twin.forward(q, None, None, cache, meta, 0.25), backend.forward(q, None, None, cache, meta, 0.25)
    )
    torch_backend = TorchAttentionBackend()
    assert torch_backend.twin() is torch_backend  # no scratch: every forward allocates its own


def run_through_halves(folder, prompts: list[list[int]], new_tokens: int, groups: int) -> list[int]:
    """Greedy tokens of `prompts` with every decode step run as the two halves would be replayed (eagerly:
    buckets of 4 and 8 split), each step's halves checked against the full batch; returns the split
    buckets run."""
    llm = LLM(str(folder), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, **ENGINE)
    runner = llm.engine.runner  # type: ignore[attr-defined]
    assert runner.buffers.num_groups == groups
    graphs = DecodeGraphs(
        runner.model,
        runner.attention_batch,
        runner.kv_caches,
        runner.buffers,
        8,
        128,
        split_from=4,
        second_backend=runner.backend.twin(),
    )
    assert graphs.sizes == [1, 2, 4, 8] and graphs.is_split(4) and not graphs.is_split(2)
    plain = DecodeGraphs(runner.model, runner.attention_batch, runner.kv_caches, runner.buffers, 8, 128)
    assert not any(plain.is_split(b) for b in plain.sizes)  # the option off: one graph per bucket
    split: list[int] = []

    def replay(b: int) -> torch.Tensor:
        if not graphs.is_split(b):
            return graphs._forward(b)
        split.append(b)
        # The halves first: each reads the K/V of this step's token that it wrote itself, so a slot or
        # block-table mix-up shows here (the full batch, run second, then writes every slot right).
        halves = torch.cat([graphs._forward_half(b, 0), graphs._forward_half(b, 1)])
        # Padding rows (empty contexts) are NaN in both.
        torch.testing.assert_close(halves, graphs._forward(b), rtol=1e-5, atol=1e-5, equal_nan=True)
        return halves

    graphs.replay = replay  # type: ignore[method-assign]
    runner.graphs = graphs
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(new_tokens), use_tqdm=False)
    ref = load_reference(folder)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, new_tokens)[0], (
            f"{len(prompt)} tokens"
        )
    return split


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in lengths]


def test_halves_give_the_full_batch_and_transformers_tokens(tmp_path) -> None:
    """One KV cache group: six decodes run in a bucket of 8 (half 1: two real rows, two padding), then
    three in a bucket of 4 as the shorter requests finish."""
    folder = make_tiny_checkpoint(tmp_path, "qwen3")
    split = run_through_halves(folder, prompts_of([1, 5, 9, 3, 17, 12], seed=1), 8, groups=1)
    split += run_through_halves(folder, prompts_of([7, 2, 11], seed=2), 6, groups=1)
    assert 8 in split and 4 in split


def test_halves_read_each_kv_cache_group_at_their_offset(tmp_path) -> None:
    """Several KV cache groups (three sliding-window layers and one full one make four groups of one
    layer, engine/kv_groups.py): each half writes and reads its rows of every group's slot run and block
    table; contexts pass the window of 8."""
    folder = make_tiny_checkpoint(tmp_path, "qwen3", name="windowed", **WINDOWED)
    split = run_through_halves(folder, prompts_of([3, 14, 9, 21, 6], seed=3), 10, groups=4)
    assert 8 in split


class FakeCuda:
    """Just enough of torch.cuda to run DecodeGraphs.capture and SplitGraph.replay on the CPU: a
    "captured" block runs once, eagerly, and every stream, event and replay call is logged in order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.main = self.Stream()
        self.current = self.main
        self._pools = 0

    def install(self, monkeypatch) -> None:
        from contextlib import contextmanager

        fake = self

        class Graph:
            def replay(self) -> None:
                fake.log.append(("replay", self, fake.current))

        class Event:
            def record(self, stream=None) -> None:
                fake.log.append(("record", self, stream))

        @contextmanager
        def on(stream):
            before, fake.current = fake.current, stream
            try:
                yield
            finally:
                fake.current = before

        @contextmanager
        def graph(g, pool=None, stream=None):
            fake.log.append(("capture", g, pool, stream))
            with on(stream if stream is not None else "capture stream"):
                yield

        def pool_handle():
            fake._pools += 1
            return ("pool", fake._pools)

        for name, value in dict(
            CUDAGraph=Graph,
            Event=Event,
            Stream=self.Stream,
            graph=graph,
            stream=on,
            current_stream=lambda: fake.current,
            graph_pool_handle=pool_handle,
            synchronize=lambda *a: None,
        ).items():
            monkeypatch.setattr(torch.cuda, name, value)

    class Stream:
        def __init__(self, device=None) -> None:
            self.waits: list = []

        def wait_stream(self, other) -> None:
            self.waits.append(other)

        def wait_event(self, event) -> None:
            self.waits.append(event)


def test_capture_gives_each_half_its_pool_and_stream_and_replay_orders_them(tmp_path, monkeypatch) -> None:
    """The capture and replay plumbing, with torch.cuda faked (FakeCuda): split buckets are captured as
    two graphs, half 0 in the single graphs' pool and half 1 in another, each on the side stream it
    replays on; both write their rows of one output; a replay starts both halves after the current
    stream's inputs and makes the current stream wait for both."""
    from overnight.runner.decode_overlap import SplitGraph

    folder = make_tiny_checkpoint(tmp_path, "qwen3")
    llm = LLM(str(folder), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, **ENGINE)
    runner = llm.engine.runner  # type: ignore[attr-defined]
    fake = FakeCuda()
    fake.install(monkeypatch)
    graphs = DecodeGraphs(
        runner.model,
        runner.attention_batch,
        runner.kv_caches,
        runner.buffers,
        8,
        128,
        4,
        runner.backend.twin(),
    )
    graphs.capture()
    captures = [entry[1:] for entry in fake.log if entry[0] == "capture"]
    single_pool = captures[-1][1]  # bucket 1, captured last
    assert all(isinstance(graphs.graphs[b], SplitGraph) for b in (4, 8))
    assert not any(isinstance(graphs.graphs[b], SplitGraph) for b in (1, 2))
    split, four = graphs.graphs[8], graphs.graphs[4]
    s0, s1 = split.streams
    assert four.streams == (s0, s1)
    halves = {split.graphs[0]: 0, four.graphs[0]: 0, split.graphs[1]: 1, four.graphs[1]: 1}
    assert len(captures) == 2 + 2 + 2
    for g, pool, stream in captures:
        if g in halves:
            assert stream is (s0, s1)[halves[g]] and (pool == single_pool) == (halves[g] == 0)
        else:
            assert stream is None and pool == single_pool
    out8, out4 = graphs.outputs[8], graphs.outputs[4]
    assert out8.shape == (8, 64) and out4.shape == (4, 64) and out4.data_ptr() == out8.data_ptr()
    # Bucket 4, captured last, left its halves' rows of the shared output: the full batch's rows.
    torch.testing.assert_close(out4, graphs._forward(4), rtol=1e-5, atol=1e-5, equal_nan=True)

    fake.log.clear()
    assert graphs.replay(8) is out8
    ready, done0, done1 = split._inputs_ready, *split._halves_done
    assert fake.log == [
        ("record", ready, fake.main),
        ("replay", split.graphs[0], s0),
        ("record", done0, s0),
        ("replay", split.graphs[1], s1),
        ("record", done1, s1),
    ]
    assert s0.waits[-1] is ready and s1.waits[-1] is ready and fake.main.waits[-2:] == [done0, done1]


# ---------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def archs():
    return {
        name: resolve_source(name, load_format="dummy").arch
        for name in ("qwen3-8b", "deepseek-v2-lite", "qwen3.5-9b")
    }


def overlap_config(arch, **changes) -> EngineConfig:
    """A configuration decode_overlap runs with, then `changes` (runner, lora, ...)."""
    config = EngineConfig(
        model=ModelConfig(model="m", arch=arch, dtype=torch.bfloat16),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=4096),
        runner=RunnerConfig(device="cuda", decode_overlap=True),
    )
    return replace(config, **changes)


def test_the_option_runs_on_a_gpu_with_graphs_and_a_large_batch(archs) -> None:
    check_decode_overlap(overlap_config(archs["qwen3-8b"]))
    check_decode_overlap(
        overlap_config(archs["qwen3-8b"], runner=RunnerConfig(device="cuda:1", decode_overlap=True))
    )
    at_least = SchedulerConfig(max_num_seqs=SPLIT_FROM, max_num_batched_tokens=8192)
    check_decode_overlap(overlap_config(archs["qwen3-8b"], scheduler=at_least))
    # Off, nothing is refused.
    check_decode_overlap(overlap_config(archs["deepseek-v2-lite"], runner=RunnerConfig(device="cpu")))


REFUSED = [
    ("cpu", dict(runner=RunnerConfig(device="cpu", decode_overlap=True)), "needs CUDA graphs on a GPU"),
    ("eager", dict(runner=RunnerConfig(device="cuda", decode_overlap=True, enforce_eager=True)), "enforce_eager"),
    ("pooling", dict(model="pooling"), "pooling runner"),
    ("tp", dict(parallel=ParallelConfig(tensor_parallel_size=2)), "tensor_parallel_size"),
    ("lora", dict(lora=LoRAConfig()), "enable_lora"),
    ("mla", dict(arch="deepseek-v2-lite"), "latent attention"),
    ("hybrid", dict(arch="qwen3.5-9b"), "linear-attention or Mamba"),
    ("small", dict(scheduler=SchedulerConfig(max_num_seqs=200, max_num_batched_tokens=8192)), "at most 200"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "says"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_where_it_cannot_run(archs, changes, says) -> None:
    changes = dict(changes)
    arch = archs[changes.pop("arch", "qwen3-8b")]
    base = overlap_config(arch)
    if changes.get("model") == "pooling":
        changes["model"] = replace(base.model, runner="pooling")
    with pytest.raises(ConfigError, match="decode_overlap") as err:
        check_decode_overlap(replace(base, **changes))
    assert says in str(err.value)


def test_a_cpu_engine_refuses_it_before_loading_weights(tmp_path, monkeypatch) -> None:
    import overnight.loader.model_loader as loader

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the option was refused")

    monkeypatch.setattr(loader, "load_model", refuse)
    folder = make_tiny_checkpoint(tmp_path, "qwen3")
    with pytest.raises(ConfigError, match="needs CUDA graphs on a GPU.*runs on 'cpu'"):
        LLM(str(folder), decode_overlap=True, **ENGINE)


def test_every_command_has_the_flag() -> None:
    import argparse

    from overnight.options import add_engine_args, options_from_args, options_to_flags

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    opts = options_from_args(parser.parse_args(["--decode-overlap"]), "batch")
    assert opts.decode_overlap and options_to_flags(opts) == ["--decode-overlap"]
    assert not options_from_args(parser.parse_args([]), "batch").decode_overlap


# ---------------------------------------------------------------- on a GPU


@pytest.mark.slow  # two engines, 300 requests
@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode_overlap replays CUDA graphs on a GPU")
def test_gpu_tokens_equal_with_and_without_overlap(tmp_path) -> None:
    """300 concurrent greedy requests (decode batches of 300, 200 and 100: the first in a split bucket
    of 320) give the same tokens with the halves' graphs replayed on two streams as with one graph. The
    tiny model's 2 KV heads and the long max_model_len make the halves' decode kernel split each row's
    context over several programs (the full bucket's does not), so half 1's own workspace matters."""
    from overnight.runner.decode_overlap import SplitGraph

    folder = make_tiny_checkpoint(tmp_path, "qwen3", max_position_embeddings=2048)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(4, 40))] for _ in range(300)]
    params = [greedy(8 * (1 + i % 3)) for i in range(300)]
    kw = dict(
        skip_tokenizer_init=True,
        dtype="float32",
        max_num_seqs=320,
        max_num_batched_tokens=8192,  # every prompt prefilled in a step or two: then 300 decodes
        max_model_len=2048,
        kv_cache_memory_bytes=256 * 2**20,
    )
    results = []
    for overlap in (False, True):
        llm = LLM(str(folder), decode_overlap=overlap, **kw)
        runner = llm.engine.runner  # type: ignore[attr-defined]
        graphs = runner.graphs
        assert isinstance(graphs.graphs[320], SplitGraph) == overlap
        assert isinstance(graphs.graphs[224], SplitGraph) is False
        assert runner.backend.num_splits(160) > 1 and runner.backend.num_splits(320) == 1
        replayed: list[int] = []
        replay = graphs.replay

        def counted(b: int, replay=replay, replayed=replayed) -> torch.Tensor:
            replayed.append(b)
            return replay(b)

        graphs.replay = counted
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert 320 in replayed
        results.append([list(o.outputs[0].token_ids) for o in outs])
        del llm, runner, graphs, counted, replay
        gc.collect()
        torch.cuda.empty_cache()
    assert results[0] == results[1]
