"""The server a sweep measures: found at --url (any OpenAI-compatible server), or started here (ours,
as a subprocess or in a thread), and what the sweep learns of it before measuring: its model, its
limits and whether it serves /metrics, and whether it runs on this machine (its GPU clocks are then
ours to read)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from overnight.options import SUBMISSION_OPTIONS, options_from_args, options_to_flags


@dataclass(frozen=True)
class Target:
    """The server a sweep measures, as far as a level needs to know it."""

    url: str
    model: str
    api_key: str | None = None
    has_metrics: bool = True  # serves Prometheus /metrics (ours, vLLM's)
    local: bool = True  # runs on this machine: its GPU's clocks are ours to read

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None


def raise_open_files_limit() -> None:
    """A socket per stream on both ends: 1024 streams overrun the usual soft limit of 1024 open files.
    Raised to the hard limit here, and inherited by an own server and the load processes."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 1 << 16
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass  # not on this platform, or not allowed: streams beyond the limit will fail and be counted


# -- the server ---------------------------------------------------------------------------------------


@contextmanager
def server_for(args: argparse.Namespace) -> Iterator[str]:
    if args.url:
        yield args.url.rstrip("/")
    elif args.server == "thread":
        from overnight.build import build_engine
        from overnight.metrics import hide_created_series
        from overnight.server.background import BackgroundServer
        from overnight.server.cli import ServerOptions, engine_options, make_app

        hide_created_series()
        engine = build_engine(engine_options(args))
        opts = ServerOptions(access_log=False, log_level="warning", stream_interval=args.stream_interval)
        app = make_app(engine, opts, model_arg=args.model)
        with BackgroundServer(app, log_level="warning") as server:
            yield server.url
    else:
        yield from _subprocess_server(args)


def _subprocess_server(args: argparse.Namespace) -> Iterator[str]:
    with socket.socket() as s:  # a free port; the tiny race with other programs is accepted
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "overnight",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-access-log",
        # uvicorn's own level (the project's loggers log at INFO from the command line whatever it is):
        # info adds uvicorn's start-up and shutdown lines to server.log, beside the engine's
        "--log-level",
        "info",
        "--stream-interval",
        str(args.stream_interval),
        *engine_flags(args),
    ]
    log_path = os.path.join(args.out, "server.log")
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        print(f"starting the server: {' '.join(cmd[1:])} (log: {log_path})", file=sys.stderr)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, proc, args.server_timeout_s, log_path)
            yield url
        finally:
            proc.terminate()  # SIGTERM: a graceful drain
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine options given to the sweep, as `overnight serve` flags (only those off their default)."""
    return options_to_flags(options_from_args(args, mode="server"), skip=SUBMISSION_OPTIONS)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log_path: str) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"the server exited ({proc.returncode}) during start-up:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not start within {timeout_s:.0f} s (log: {log_path})")
        time.sleep(0.5)


def server_info(url: str, api_key: str | None) -> dict[str, object]:
    """The model card, and from /metrics the engine's limits; a server without /metrics is measured
    from the client's side only. Raises ServerUnreachableError (one line on the command line) when the
    server is down, wants a key, or lists no model."""
    from overnight.bench.metrics_reader import parse_metrics
    from overnight.bench.reach import first_model, get
    from overnight.errors import ServerUnreachableError

    card = first_model(url, api_key)
    info: dict[str, object] = {"url": url, "model": card["id"], "max_model_len": card.get("max_model_len")}
    try:
        snap = parse_metrics(get(url, "/metrics", api_key, timeout=10.0).text)
        info["metrics"] = bool(snap.values)  # a page without our or vLLM's names tells nothing
        info.update(snap.limits)
    except (ServerUnreachableError, ValueError):
        info["metrics"] = False
    info["local"] = is_local(url)
    return info


def is_local(url: str) -> bool:
    """The server runs on this machine (its GPU's clocks are the ones we can read)."""
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0") or host.startswith("127."):
        return True
    try:
        name, aliases, addresses = socket.gethostbyname_ex(socket.gethostname())
        return host in (name, *aliases, *addresses) or socket.gethostbyname(host) in addresses
    except OSError:
        return False
