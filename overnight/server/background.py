"""A server running in a thread of this process, for notebooks, benchmarks and tests:

    with BackgroundServer(make_app(llm.engine, ServerOptions())) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

Signals stay with the main thread (uvicorn only installs handlers there), so stop() is the way out.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class BackgroundServer:
    def __init__(
        self,
        app: object,
        host: str = "127.0.0.1",
        port: int = 0,
        shutdown_timeout: float = 5.0,
        log_level: str = "warning",
        loop: str = "auto",
        http: str = "auto",
    ) -> None:
        # loop, http: uvicorn's choice of event loop and HTTP parser ("auto": uvloop and httptools where
        # installed); benchmarks force "asyncio" and "h11" to compare the stacks within one install.
        # Bind here, so port 0 yields a free port that is known before the thread starts.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(
            app,  # type: ignore[arg-type]
            log_level=log_level,
            access_log=False,
            lifespan="on",
            loop=loop,
            http=http,
            timeout_graceful_shutdown=max(int(round(shutdown_timeout)), 0),
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, name="overnight-http", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during start-up (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful: stop accepting, let in-flight requests finish (up to shutdown_timeout), then abort
        the rest and stop the engine thread."""
        self.server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
