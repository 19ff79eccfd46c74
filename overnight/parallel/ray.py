"""Engines as Ray actors: RayLinks, the EngineLinks of a DataParallelEngine whose engines are replicas on
a Ray cluster (`overnight run-batch --ray`, built by overnight.build.build_ray_engine). The driver reads
and writes the files and deals requests to the replicas by load, so run-batch's order, resume and error
handling are unchanged. A replica that is lost (killed, its node gone) is replaced, and its unfinished
requests are dealt again to the others from the start; an output is taken only from the replica its
request is dealt to, so none is lost or written twice.

Each replica holds one engine on tensor_parallel_size GPUs (Ray sets the actor's CUDA_VISIBLE_DEVICES),
built by the factory it is given. The Ray Data processor is overnight/ray.py. `ray[data]` is an optional
extra (pip install 'overnight[ray]'); without it these raise ImportError saying so.
"""

from __future__ import annotations

import queue
import threading
import traceback
import weakref

from overnight.engine.interfaces import EngineClient
from overnight.errors import EngineDeadError
from overnight.options import EngineOptions
from overnight.parallel.links import EngineFactory, EngineFailed, EngineLost, EngineReady, serve_engine
from overnight.parallel.workers import MULTICAST_OFF, Shutdown

RAY_MISSING = (
    "this needs Ray Data, an optional extra: pip install 'overnight[ray]' (or pip install 'ray[data]') "
    "on the driver and on every node of the cluster"
)
# A replica's take() returns after this long with nothing, so the driver's wait stays short.
TAKE_TIMEOUT_S = 5.0


def require_ray():
    """The ray module, or ImportError with the install command."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ImportError(RAY_MISSING) from e
    return ray


# -- engines as Ray actors --------------------------------------------------------------------------


class EngineServer:
    """The Ray actor holding one engine. A thread of its own runs serve_engine; the driver's messages
    come in through send(), outputs go out through take(). Only that thread touches the engine."""

    def __init__(self, index: int, opts: EngineOptions, factory: EngineFactory) -> None:
        self.index = index
        self.engine: EngineClient = factory(opts)
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._outbox: list[object] = []
        self._ready = threading.Condition()
        threading.Thread(target=self._loop, name="overnight-engine", daemon=True).start()

    def ready(self) -> EngineReady:
        return EngineReady(self.index, self.engine.config, self.engine.pool_plan)

    def send(self, msg: object) -> None:
        self._inbox.put(msg)

    def take(self, timeout_s: float) -> list[object]:
        """What the engine has said since the last take, waiting up to timeout_s for something."""
        with self._ready:
            self._ready.wait_for(lambda: self._outbox, timeout_s)
            out, self._outbox = self._outbox, []
        return out

    def _receive(self, block: bool) -> list[object]:
        messages = [self._inbox.get()] if block else []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

    def _say(self, msg: object) -> None:
        with self._ready:
            self._outbox.append(msg)
            self._ready.notify_all()

    def _loop(self) -> None:
        try:
            serve_engine(self.index, self.engine, self._receive, self._say)
        except BaseException:
            self._say(EngineFailed(self.index, traceback.format_exc()))


class RayLinks:
    """EngineLinks over Ray actors: one replica per engine, each with gpus_per_replica GPUs. A replica
    that dies is reported as EngineLost and replaced (up to max_replacements in all); its replacement
    reports EngineReady when its engine is built."""

    def __init__(
        self,
        opts: EngineOptions,
        num_replicas: int,
        factory: EngineFactory,
        *,
        gpus_per_replica: float | None = None,
        cpus_per_replica: float = 1.0,
        max_replacements: int | None = None,
    ) -> None:
        ray = require_ray()
        self._ray = ray
        self.num_engines = num_replicas
        if gpus_per_replica is None:
            has_gpus = ray.cluster_resources().get("GPU", 0) > 0
            gpus_per_replica = float(opts.tensor_parallel_size) if has_gpus else 0.0
        self._actor_cls = ray.remote(EngineServer).options(
            num_gpus=gpus_per_replica,
            num_cpus=cpus_per_replica,
            max_concurrency=4,  # take() may wait while send() calls come in
            max_restarts=0,  # replaced by a fresh actor instead: calls to a dead one never run
            runtime_env={"env_vars": dict(MULTICAST_OFF)},
        )
        self._opts = opts
        self._factory = factory
        self._replacements_left = 2 * num_replicas if max_replacements is None else max_replacements
        self._actors: list = [None] * num_replicas
        self._waiting: dict = {}  # object ref -> (replica index, "ready" | "take")
        for i in range(num_replicas):
            self._start(i)
        self._finalizer = weakref.finalize(self, _kill_actors, ray, self._actors)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def send(self, index: int, msg: object) -> None:
        if not self.alive:
            raise EngineDeadError("the Ray replicas have been shut down")
        self._actors[index].send.remote(msg)  # calls from one caller run in order

    def receive(self) -> list[object]:
        ray = self._ray
        refs = list(self._waiting)
        ray.wait(refs, num_returns=1)  # block until one is ready, then take every one that is
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        messages: list[object] = []
        for ref in done:
            index, kind = self._waiting.pop(ref)
            try:
                got = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                if getattr(e, "actor_init_failed", False):
                    raise EngineDeadError(f"Ray replica {index} could not start its engine:\n{e}") from None
                messages.append(EngineLost(index, str(e)))
                self._replace(index, str(e))
                continue
            if kind == "ready":
                messages.append(got)
            else:
                for msg in got:
                    if isinstance(msg, EngineFailed):
                        raise EngineDeadError(f"Ray replica {index} failed:\n{msg.error}")
                    messages.append(msg)
            self._waiting[self._actors[index].take.remote(TAKE_TIMEOUT_S)] = (index, "take")
        return messages

    def close(self) -> None:
        self._finalizer()

    def _start(self, index: int) -> None:
        actor = self._actor_cls.remote(index, self._opts, self._factory)
        self._actors[index] = actor
        self._waiting[actor.ready.remote()] = (index, "ready")

    def _replace(self, index: int, reason: str) -> None:
        if self._replacements_left <= 0:
            self.close()
            raise EngineDeadError(f"Ray replica {index} was lost and no replacements are left: {reason}")
        self._replacements_left -= 1
        self._ray.kill(self._actors[index], no_restart=True)
        self._start(index)


def _kill_actors(ray, actors: list) -> None:
    for actor in actors:
        if actor is not None:
            try:
                actor.send.remote(Shutdown())
                ray.kill(actor, no_restart=True)
            except Exception:  # the cluster may be gone already at exit
                pass
