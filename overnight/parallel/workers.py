"""Tensor parallel workers: one process per rank, driven by typed messages over pipes.

    engine process (driver)                        rank r process, r = 0 .. world-1 (cuda:r or CPU)
    TPRunner.execute(SchedulerOutput) --Execute--> every rank: ModelRunner.execute, the unchanged
      (pickled once, written to every pipe)          single-device code on its shard: all-reduces in the
                                                     forward, logits all-gathered, every rank samples;
                                                     rank 0 broadcasts its tokens, the others adopt them
    <------------- ModelRunnerOutput ------------- rank 0 only

Every rank keeps the same RequestStates copy (they apply the same SchedulerOutputs and the same tokens),
so each rank builds identical step inputs and runs the same collectives in the same order. The driver
never joins the process group and never touches a GPU: several engines (tests, data parallel) can each
drive their own group from one process. While waiting for rank 0 the driver also watches every other
rank, so a rank that fails or dies raises here instead of leaving the group hung in a collective.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from overnight.config import EngineConfig
from overnight.engine.step_io import ModelRunnerOutput, SchedulerOutput
from overnight.errors import EngineDeadError
from overnight.loader.source import ModelSource
from overnight.logs import LogSetup

# NVLink multicast (NVLS) off in every process we start: the GPU machines do not support it reliably.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


# -- messages (driver -> rank) ----------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerInit:
    config: EngineConfig  # the whole model's; each rank derives its share
    source: ModelSource
    rank: int
    world: int
    backend: str  # "nccl" | "gloo"
    init_method: str  # tcp://127.0.0.1:PORT


@dataclass(frozen=True)
class SizeKVPool:
    """Measure the memory left for this rank's KV share; every rank answers KVPoolShare."""


@dataclass(frozen=True)
class AllocateKVCache:
    num_blocks: int  # the same on every rank: the scheduler's block ids address all shares at once


@dataclass(frozen=True)
class Execute:
    out: SchedulerOutput  # only rank 0 answers, with a ModelRunnerOutput


@dataclass(frozen=True)
class Shutdown:
    pass


# -- messages (rank -> driver) ----------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    rank: int
    kv_cache_dtype: torch.dtype


@dataclass(frozen=True)
class KVPoolShare:
    budget_bytes: int
    block_bytes: int  # of this rank's share of one block (its kv heads only)


@dataclass(frozen=True)
class Done:
    pass


@dataclass(frozen=True)
class WorkerFailed:
    rank: int
    error: str  # formatted traceback


# -- process plumbing, shared with data parallel ----------------------------------------------------

_ENV_LOCK = threading.Lock()


def child_env(threads: int | None = None, cuda_visible_devices: str | None = None) -> dict[str, str]:
    """Environment for a process we start: multicast off, and a CPU thread share unless the user set
    OMP_NUM_THREADS (processes sharing the cores must not each start one thread per core)."""
    env = dict(MULTICAST_OFF)
    if threads is not None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, threads))
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


@contextlib.contextmanager
def spawn_environment(extra: dict[str, str]) -> Iterator[None]:
    """Set `extra` in os.environ while a process is started (a spawned child inherits the environment
    at start, before it imports anything), then restore ours."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PipeSender:
    """Writes to a pipe from a thread of its own. The caller never blocks on a full pipe, so it can
    always go on reading: otherwise a large message each way can leave both sides blocked in a write,
    each waiting for the other to read."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, msg: object) -> None:
        self.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def send_bytes(self, data: bytes) -> None:
        self._queue.put(data)

    def close(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):
                return  # the other side is gone; whoever reads from it reports that


def stop_processes(
    procs: list[mp.process.BaseProcess],
    senders: list[PipeSender],
    conns: list[Connection],
    grace_s: float = 10.0,
) -> None:
    """Ask each process to stop, wait up to grace_s, then kill the rest (they ignore SIGTERM: see
    leave_stopping_to_driver)."""
    deadline = time.monotonic() + grace_s
    for sender in senders:
        sender.send(Shutdown())
    for sender in senders:
        sender.close(max(0.0, deadline - time.monotonic()))
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    for conn in conns:
        conn.close()


def rank_device(device: str, rank: int) -> str:
    """Rank r runs on the r-th GPU from the configured one (cuda:0 unless told otherwise)."""
    d = torch.device(device)
    return f"cuda:{(d.index or 0) + rank}" if d.type == "cuda" else str(d)


# -- the rank process -------------------------------------------------------------------------------


def _start_rank(init: WorkerInit):
    from overnight.parallel.tp_load import load_sharded_model
    from overnight.parallel.tp_shards import TPShards
    from overnight.runner.model_runner import ModelRunner

    config = init.config
    device = rank_device(config.runner.device, init.rank)
    on_gpu = device.startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(
        init.backend,
        init_method=init.init_method,
        rank=init.rank,
        world_size=init.world,
        device_id=torch.device(device) if on_gpu else None,
    )
    model = load_sharded_model(
        init.source, config.model.dtype, device, init.rank, init.world, seed=config.model.seed
    )
    local = replace(
        config,
        model=replace(config.model, arch=TPShards(config.model.arch, init.rank, init.world).local_arch),
        runner=replace(config.runner, device=device),
    )
    # Rank 0's tokens decide (_adopt_rank0_tokens), so only rank 0 masks structured outputs; the others'
    # draws for those rows are replaced by rank 0's, which their states and next inputs then use.
    grammars = None
    if init.rank == 0 and init.source.tokenizer_path is not None:
        from overnight.structured.compiler import GrammarCompiler

        grammars = GrammarCompiler.for_source(init.source)
    lora_sharding = None
    if config.lora is not None:  # each adapter split like the weights it adapts (lora/slots.py)
        from overnight.lora.slots import LoRASharding

        shards = TPShards(config.model.arch, init.rank, init.world)
        lora_sharding = LoRASharding(config.model.arch, shards.shard, lambda t: dist.all_reduce(t))
    return ModelRunner(local, init.source, model=model, grammars=grammars, lora_sharding=lora_sharding)


def _adopt_rank0_tokens(runner, result: ModelRunnerOutput) -> None:
    """Every rank samples from the same gathered logits with the same seeds, so the tokens agree; rank
    0's are broadcast anyway (one tiny collective) and adopted, so no rank can ever feed a different
    token into the next forward."""
    if not result.sampled_token_ids:
        return
    t = torch.tensor(result.sampled_token_ids, dtype=torch.int64, device=runner.device)
    dist.broadcast(t, src=0)
    tokens = t.tolist()
    if tokens != result.sampled_token_ids:
        for rid, token in zip(result.req_ids, tokens, strict=True):
            runner.states.reqs[rid].token_ids[-1] = token


def _serve(runner, init: WorkerInit, conn: Connection) -> None:
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the driver is gone
            return
        if isinstance(msg, Execute):
            result = runner.execute(msg.out)
            _adopt_rank0_tokens(runner, result)
            if init.rank == 0:
                conn.send(result)
        elif isinstance(msg, SizeKVPool):
            conn.send(KVPoolShare(*runner.kv_pool_share()))
        elif isinstance(msg, AllocateKVCache):
            runner.allocate_kv_cache(msg.num_blocks)  # every rank captures the same graphs, collectives too
            conn.send(Done())
        elif isinstance(msg, Shutdown):
            return
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")


def leave_stopping_to_driver() -> None:
    """For a process the driver started (an engine process, a tensor-parallel worker): ignore SIGINT and
    SIGTERM. The driver decides when to stop: a signal sent to the whole process group (Ctrl-C, a service
    manager stopping every process of its unit) reaches this process too, and dying here would cut the
    requests the driver is still draining. A driver that dies closes the pipe, which ends this process
    as well."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _worker_main(init: WorkerInit, conn: Connection, log_setup: LogSetup) -> None:
    leave_stopping_to_driver()
    log_setup.apply()
    try:
        runner = _start_rank(init)
        conn.send(Ready(init.rank, runner.kv_cache_dtype))
        _serve(runner, init, conn)
    except BaseException:
        with contextlib.suppress(OSError, ValueError):
            conn.send(WorkerFailed(init.rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# -- the driver side --------------------------------------------------------------------------------


class TPRunner:
    """The engine's Runner over `tensor_parallel_size` rank processes (see the module docstring)."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        from overnight.parallel.tp_shards import TPShards

        self.config = config
        self.world = config.parallel.tensor_parallel_size
        self.device = torch.device(rank_device(config.runner.device, 0))  # rank 0's, which samples
        TPShards(config.model.arch, 0, self.world).check()  # before any process starts
        on_gpu = torch.device(config.runner.device).type == "cuda"
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._senders: list[PipeSender] = []
        env = child_env(threads=None if on_gpu else (os.cpu_count() or 1) // self.world)
        for rank in range(self.world):
            ours, theirs = ctx.Pipe()
            init = WorkerInit(config, source, rank, self.world, "nccl" if on_gpu else "gloo", init_method)
            proc = ctx.Process(
                target=_worker_main,
                args=(init, theirs, LogSetup.capture()),
                name=f"overnight-tp{rank}",
                daemon=True,
            )
            with spawn_environment(env):
                proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
            self._senders.append(PipeSender(ours, f"overnight-tp{rank}-send"))
        self._finalizer = weakref.finalize(self, stop_processes, self._procs, self._senders, self._conns)
        ready = self._replies(range(self.world))
        self.kv_cache_dtype: torch.dtype = ready[0].kv_cache_dtype

    def kv_pool_share(self) -> tuple[int, int]:
        """Every rank measures its share; the group gets the blocks the tightest rank can hold (a
        block's bytes are a rank's share of one block: its KV heads only)."""
        self._send_all(SizeKVPool())
        shares = self._replies(range(self.world))
        return min(s.budget_bytes for s in shares.values()), shares[0].block_bytes

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._send_all(AllocateKVCache(num_blocks))
        self._replies(range(self.world))

    # The ranks run step N while the engine schedules step N+1; each rank still runs its steps one
    # after the other, so its request states never hold a pending token.
    supports_async = True

    def launch(self, out: SchedulerOutput) -> PendingStep:
        self._send_all(Execute(out))
        return PendingStep(self)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(out).result()

    def shutdown(self) -> None:
        self._finalizer()

    def _send_all(self, msg: object) -> None:
        if not self._finalizer.alive:
            raise EngineDeadError("the tensor parallel workers have been shut down")
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)  # once for every rank
        for sender in self._senders:
            sender.send_bytes(data)

    def _replies(self, ranks: Iterable[int]) -> dict:
        """Wait for one message from each rank in `ranks`, while watching every rank for failure."""
        pending = set(ranks)
        got: dict[int, object] = {}
        rank_of_conn = {id(c): r for r, c in enumerate(self._conns)}
        rank_of_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        while pending:
            ready = wait([*self._conns, *rank_of_sentinel])
            for obj in ready:
                if not isinstance(obj, Connection):
                    continue
                rank = rank_of_conn[id(obj)]
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    self._procs[rank].join(1.0)
                    self._fail(rank, "(no message: the process is gone)")
                if isinstance(msg, WorkerFailed):
                    self._fail(rank, msg.error)
                got[rank] = msg
                pending.discard(rank)
            for obj in ready:  # a dead process with nothing left to read
                if isinstance(obj, int) and not self._conns[rank_of_sentinel[obj]].poll():
                    rank = rank_of_sentinel[obj]
                    self._procs[rank].join(1.0)
                    self._fail(rank, "(no message: the process is gone)")
        return got

    def _fail(self, rank: int, error: str) -> None:
        # A rank that died takes its peers down with it (their collectives fail): name the dead first.
        dead = [f"rank {r} exited (code {p.exitcode})" for r, p in enumerate(self._procs) if p.exitcode]
        stop_processes(self._procs, self._senders, self._conns, grace_s=0.0)
        self._finalizer.detach()
        summary = "; ".join(dead) or f"rank {rank} failed"
        raise EngineDeadError(f"tensor parallel workers failed ({summary}); rank {rank} reported:\n{error}")


class PendingStep:
    """A launched step; result() waits for rank 0's answer (steps are answered in launch order)."""

    def __init__(self, runner: TPRunner) -> None:
        self.runner = runner
        self._result: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            self._result = self.runner._replies([0])[0]
        return self._result
