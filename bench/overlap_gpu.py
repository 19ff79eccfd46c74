"""Does a decode step gain from two half-batches on two CUDA streams? Measured on the engine's own graphs.

    PYTHONPATH=. python3 bench/overlap_gpu.py [--model qwen3-8b] [--cases 1024x640,512x1536] [--seconds 3]

A decode step of a large batch runs its GEMMs (compute-bound) and its decode attention (memory-bound) one
after the other. This loads the model on dummy weights through the engine, fills the runner's static
decode buffers with B requests of C tokens of context each (block tables over the whole pool, reused
when B x C exceeds it: the bytes read are the same), and times, for each case, replays of
  full     the engine's CUDA graph of B rows (what a decode step runs today);
  serial   the graph of B/2 rows, then a second graph of B/2 rows on other buffers, one stream;
  overlap  the same two graphs on two streams at once;
  overlap+ the same with the second stream starting a fixed delay later (half of one half-batch layer), so one
           half's attention meets the other's GEMMs instead of both doing the same thing at once;
  green    (--green) each half captured and replayed in a CUDA green context of its own share of the SMs
           (torch.cuda.GreenContext): the two halves cannot take every SM in turn, so one half's
           memory-bound attention must run beside the other's GEMMs. Session K measured the variants
           above (each kernel fills the GPU, so two plain streams take turns); this is the next question.
Each variant runs back to back for --seconds (the power limit settles within a second), with the SM
clock and power sampled. The halves' outputs are checked against the full graph's rows first.
`--eager` runs the same variants without graphs or streams (a CPU check of the script on a tiny model).
Rows print as each case finishes; a variant the GPU or torch cannot run prints its error in its row.
"""

from __future__ import annotations

import argparse
import sys
import time

sys.path.insert(0, ".")

import torch  # noqa: E402

from overnight import LLM  # noqa: E402
from overnight.bench.gpu_info import ClockSampler  # noqa: E402
from overnight.runner.cuda_graph import DecodeGraphs  # noqa: E402
from overnight.runner.inputs import StepBuffers  # noqa: E402


def fill(buf: StepBuffers, rows: range, batch: int, context: int, num_blocks: int, vocab: int) -> None:
    """Rows [0, len(rows)) of buf: decode requests rows[i] of `batch`, `context` tokens each, no cache
    writes (slot -1), each request's own blocks (modulo the pool)."""
    n = len(rows)
    bs = buf.block_size
    per = -(-context // bs)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, vocab - 100, (batch,), generator=g)[rows.start : rows.stop]
    buf.ids[:n].copy_(ids)
    buf.pos[:n].fill_(context - 1)
    buf.seq_lens[:n].fill_(context)
    buf.slots[: buf.num_groups * n].fill_(-1)
    req = torch.arange(rows.start, rows.stop).unsqueeze(1)
    blocks = (req * per + torch.arange(per).unsqueeze(0)) % num_blocks
    buf.tables[:, :n].zero_()
    buf.tables[:, :n, :per].copy_(blocks.to(torch.int32).unsqueeze(0).expand(buf.num_groups, -1, -1))
    buf.qsl[: n + 1].copy_(torch.arange(n + 1, dtype=buf.qsl.dtype))


def timed(run, seconds: float, cuda: bool) -> tuple[float, dict]:
    """ms per call of run() over about `seconds`, and the clock summary."""
    for _ in range(3):
        run()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize()
    iters = max(3, int(seconds / max(time.perf_counter() - t0, 1e-4)))
    with ClockSampler(0, enabled=cuda) as clocks:
        start = time.perf_counter()
        for _ in range(iters):
            run()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return 1e3 * elapsed / iters, clocks.samples.summary()


def green_halves(graphs: tuple[DecodeGraphs, DecodeGraphs], h: int):
    """A run() replaying half A's and half B's graphs, each captured on the stream of a green context of
    half the SMs (rounded down to 8: Hopper partitions SMs in groups of 8)."""
    from torch.cuda.green_contexts import GreenContext

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    share = sms // 2 // 8 * 8
    # The contexts must outlive their streams and graphs: a context only the list comprehension held
    # was freed at once, and the first launch failed with "context is destroyed" (session L).
    contexts = [GreenContext.create(num_sms=share) for _ in range(2)]
    streams = [ctx.Stream() for ctx in contexts]
    captured = []
    for dg, stream in zip(graphs, streams):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            dg._forward(h)  # warm-up on the green stream (its kernels compiled already)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            dg._forward(h)
        captured.append(graph)

    def run(_keep=contexts) -> None:
        cur = torch.cuda.current_stream()
        for stream, graph in zip(streams, captured):
            stream.wait_stream(cur)
            with torch.cuda.stream(stream):
                graph.replay()
        for stream in streams:
            cur.wait_stream(stream)

    return run, share


def run_case(llm: LLM, batch: int, context: int, seconds: float, cuda: bool, green: bool) -> list[str]:
    """The table rows of one case: the full graph, then the two halves serial, overlapped, offset."""
    runner = llm.engine.runner
    vocab = llm.engine.config.model.arch.vocab_size
    num_blocks = runner.kv_caches[0].shape[1]
    max_len = llm.engine.config.scheduler.max_model_len
    out: list[str] = []
    h = batch // 2
    buf_a = runner.buffers
    buf_b = StepBuffers(h, h, runner.max_blocks_per_req, runner.block_size, runner.device, buf_a.num_groups)
    half_b = DecodeGraphs(runner.model, runner.attention_batch, runner.kv_caches, buf_b, h, max_len)
    half_b.sizes = [h]
    if cuda:
        assert runner.graphs is not None and {batch, h} <= set(runner.graphs.graphs), runner.graphs.sizes
        half_b.capture()  # its own memory pool: the two halves may run at once

        def full() -> torch.Tensor:
            return runner.graphs.replay(batch)

        def half(which: int) -> torch.Tensor:
            return runner.graphs.replay(h) if which == 0 else half_b.replay(h)
    else:
        full_g = DecodeGraphs(runner.model, runner.attention_batch, runner.kv_caches, buf_a, batch, max_len)

        def full() -> torch.Tensor:
            return full_g._forward(batch)

        def half(which: int) -> torch.Tensor:
            return full_g._forward(h) if which == 0 else half_b._forward(h)

    # The full batch's rows, then each half's: the halves must give the same hidden states.
    fill(buf_a, range(0, batch), batch, context, num_blocks, vocab)
    ref = full().clone()
    fill(buf_b, range(h, batch), batch, context, num_blocks, vocab)
    a, b = half(0).clone(), half(1).clone()
    err = max(
        ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
        for x, y in ((a, ref[:h]), (b, ref[h:batch]))
    )
    print(f"case {batch} x {context}: halves against the full batch, max relative error {err:.2e}")
    if err > 3e-2:
        print("  MISMATCH: the halves do not reproduce the full batch")
    side = [torch.cuda.Stream() for _ in range(2)] if cuda else []
    layer_ms = [0.0]

    def serial() -> None:
        half(0)
        half(1)

    def overlap(delay_ms: float = 0.0) -> None:
        if not cuda:
            return serial()
        cur = torch.cuda.current_stream()
        for k, s in enumerate(side):
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                if k == 1 and delay_ms > 0:
                    torch.cuda._sleep(int(delay_ms * 1e-3 * cycles_per_s))
                half(k)
        for s in side:
            cur.wait_stream(s)

    cycles_per_s = 1.98e9  # torch.cuda._sleep counts SM cycles; a throttled clock only stretches it
    t_full, c_full = timed(full, seconds, cuda)
    layer_ms[0] = t_full / llm.engine.config.model.arch.num_hidden_layers
    variants = [("full", t_full, c_full)]
    for name, fn in (
        ("serial", serial),
        ("overlap", overlap),
        ("overlap+", lambda: overlap(layer_ms[0] / 4)),
    ):
        ms, clk = timed(fn, seconds, cuda)
        variants.append((name, ms, clk))
    if green and cuda:
        try:
            half_a = DecodeGraphs(runner.model, runner.attention_batch, runner.kv_caches, buf_a, h, max_len)
            run, share = green_halves((half_a, half_b), h)
            ms, clk = timed(run, seconds, cuda)
            variants.append((f"green {share}+{share} SMs", ms, clk))
        except Exception as e:  # an old driver, torch without green contexts, a capture it refuses
            out.append(
                f"| {batch} x {context} | green | failed: {type(e).__name__}: {str(e)[:200]} | | | | |"
            )
    for name, ms, clk in variants:
        out.append(
            f"| {batch} x {context} | {name} | {ms:.2f} | {batch / ms * 1e3:,.0f} | {t_full / ms:.3f}x "
            f"| {clk.get('sm_clock_mhz_median')} ({clk.get('sm_clock_mhz_min')}) | {clk.get('power_w_median')} |"
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--cases", default="1024x640,512x1536", help="BATCHxCONTEXT, comma-separated")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--eager", action="store_true", help="no graphs or streams (CPU check)")
    ap.add_argument("--green", action="store_true", help="also the halves in green contexts of half the SMs")
    args = ap.parse_args()
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    max_batch = max(b for b, _ in cases)
    cuda = torch.cuda.is_available() and not args.eager
    llm = LLM(
        model=args.model,
        load_format="dummy" if not args.model.startswith("/") else "auto",
        max_num_seqs=max_batch,
        max_model_len=max(c for _, c in cases) + 64,
        enforce_eager=not cuda,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.85,  # room for the second half's graph and its memory pool
    )
    runner = llm.engine.runner
    num_blocks = runner.kv_caches[0].shape[1]
    max_len = llm.engine.config.scheduler.max_model_len
    print(f"{args.model}: pool {num_blocks} blocks of {runner.block_size}; max_model_len {max_len}")
    print("| case | variant | ms / step | decode tok/s | x full | SM MHz median (min) | W |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for batch, context in cases:
        print("\n".join(run_case(llm, batch, context, args.seconds, cuda, args.green)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
