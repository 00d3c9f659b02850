"""A real uvicorn server in a thread of the test process, and reading its Prometheus metrics."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import httpx
import uvicorn


def free_port() -> int:
    """A loopback port free now (the server that takes it binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.serve())

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.time() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while httpx.get(self.url + "/health").status_code != 200:
            assert time.time() < deadline, "never became ready"
            time.sleep(0.05)


class HealthWatch:
    """Polls ``/health`` from a thread while the ``with`` block runs: each probe's status and latency."""

    def __init__(self, url: str, every_s: float = 0.02) -> None:
        self.url, self.every_s = url, every_s
        self.probes: list[tuple[int, float]] = []
        self._done, self._first = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._poll)

    def _poll(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            while not self._done.is_set():
                start = time.perf_counter()
                status = http.get("/health").status_code
                self.probes.append((status, time.perf_counter() - start))
                self._first.set()
                time.sleep(self.every_s)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        self._first.wait(10)  # probing before the work starts, however busy the machine
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def assert_always_fast(self, min_probes: int, limit_s: float = 1.0) -> None:
        assert len(self.probes) > min_probes and {status for status, _ in self.probes} == {200}, self.probes[:5]
        slowest = max(latency for _, latency in self.probes)
        assert slowest < limit_s, slowest


def metric(server: ServerThread, name: str) -> float:
    total = 0.0
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total
