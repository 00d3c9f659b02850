"""The server's limits: what a request may cost, who may ask, and how it shuts down.

Each test runs a real uvicorn server (in a thread, or as ``python -m runtime.serve``) and
talks to it over loopback with real clients.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from runtime.engine import Engine
from runtime.loading import LoadedModel
from runtime.models.dflash import DFlashDrafter
from runtime.server import ServerSettings, create_app

from .servers import HealthWatch, ServerThread, free_port, metric

MODEL = "tiny"
PROMPT = "The quick brown fox 3"


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, **fields}


def serve(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter, **settings: Any) -> ServerThread:
    settings = {"model_name": MODEL, "warmup": False, "enable_internal_stats": True, **settings}
    return ServerThread(create_app(Engine(tiny_llama, tiny_drafter), ServerSettings(**settings)))


def greedy_text(srv: ServerThread, **fields: Any) -> str:
    r = httpx.post(srv.url + "/v1/completions", json=completion(**fields), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_block_larger_than_the_drafters_gets_400_before_admission(tiny_llama: LoadedModel,
                                                                    tiny_drafter: DFlashDrafter) -> None:
    with serve(tiny_llama, tiny_drafter) as srv:
        r = httpx.post(srv.url + "/v1/completions", json=completion(block_size=tiny_drafter.block_size + 1))
        assert r.status_code == 400 and r.json()["error"]["param"] == "block_size", r.text
        assert str(tiny_drafter.block_size) in r.json()["error"]["message"] and "runtime." not in r.text
        assert metric(srv, "dflash_prompt_tokens_total") == 0  # nothing was admitted
        r = httpx.post(srv.url + "/v1/completions", json=completion(block_size=tiny_drafter.block_size, temperature=0))
        assert r.status_code == 200


@pytest.mark.parametrize("fields", [{"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 1e-6},
                                    {"temperature": 1.0, "top_p": 5e-324}, {"temperature": 0.7, "top_p": 1e-40}])
def test_temperature_or_top_p_that_underflows_float32_decodes_greedily(tiny_llama: LoadedModel,
                                                                       tiny_drafter: DFlashDrafter,
                                                                       fields: dict[str, float]) -> None:
    """Below 1e-5 a temperature is greedy (as vLLM); a top_p that rounds to 0 keeps the likeliest token."""
    with serve(tiny_llama, tiny_drafter) as srv:
        want = greedy_text(srv, temperature=0)
        r = httpx.post(srv.url + "/v1/completions", json=completion(**fields, seed=3))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        assert r.json()["choices"][0]["finish_reason"] == "length"


def test_a_body_over_the_limit_gets_413_and_large_bodies_never_stall_health(tiny_llama: LoadedModel,
                                                                             tiny_drafter: DFlashDrafter) -> None:
    with serve(tiny_llama, tiny_drafter, max_body_bytes=3 * 1024 * 1024) as srv:
        with HealthWatch(srv.url, every_s=0.01) as health:
            big = json.dumps(completion(prompt="fox " * 700_000))  # 2.8 MB: parsed off the loop, refused untokenized
            r = httpx.post(srv.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                           timeout=120)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
            too_big = json.dumps(completion(prompt="fox " * 1_000_000))  # 4 MB
            r = httpx.post(srv.url + "/v1/completions", content=too_big, headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

            def chunks() -> Any:  # no Content-Length: refused once the bytes read pass the limit
                for _ in range(64):
                    yield b" " * (256 * 1024)

            r = httpx.post(srv.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413
        health.assert_always_fast(min_probes=2)  # few where the body work holds the GIL: each still answered fast


def test_posts_must_be_json(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> None:
    with serve(tiny_llama, tiny_drafter) as srv:
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"content-type": content_type} if content_type else {}
            r = httpx.post(srv.url + "/v1/completions", content=json.dumps(completion()), headers=headers)
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (content_type, r.text)
        r = httpx.post(srv.url + "/v1/completions", content=json.dumps(completion(temperature=0)),
                       headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 200


def test_an_api_key_guards_the_v1_routes_and_the_openai_client_passes_it(tiny_llama: LoadedModel,
                                                                        tiny_drafter: DFlashDrafter) -> None:
    with serve(tiny_llama, tiny_drafter, api_key="s3cret") as srv:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            r = httpx.post(srv.url + "/v1/completions", json=completion(), headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
            assert httpx.get(srv.url + "/v1/models", headers=headers).status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        direct = httpx.post(srv.url + "/v1/completions", json=completion(temperature=0),
                            headers={"authorization": "Bearer s3cret"})
        assert out.choices[0].text == direct.json()["choices"][0]["text"]


def test_unknown_hosts_docs_and_internal_stats_are_refused_unless_allowed(tiny_llama: LoadedModel,
                                                                          tiny_drafter: DFlashDrafter) -> None:
    with serve(tiny_llama, tiny_drafter, allowed_hosts=["127.0.0.1", "localhost"],
               enable_internal_stats=False) as srv:
        assert httpx.get(srv.url + "/health", headers={"host": "attacker.example"}).status_code == 400
        assert httpx.get(srv.url + "/health", headers={"host": f"localhost:{srv.port}"}).status_code == 200
        for path in ("/docs", "/openapi.json", "/v1/internal/stats"):
            assert httpx.get(srv.url + path).status_code == 404, path
        name = "m" * 500
        r = httpx.post(srv.url + "/v1/completions", json=completion(model=name))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert name not in r.text and "m" * 40 in r.text
    with serve(tiny_llama, tiny_drafter, enable_docs=True) as srv:
        for path in ("/docs", "/openapi.json", "/v1/internal/stats"):
            assert httpx.get(srv.url + path).status_code == 200, path


def _take_the_only_slot(srv: ServerThread) -> None:
    admission = srv.app.state.server.admission
    asyncio.run_coroutine_threadsafe(admission.acquire(), srv.loop).result(5)


def _wait_for(predicate: Any, timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def test_a_client_that_leaves_the_queue_frees_its_place_at_once(tiny_llama: LoadedModel,
                                                               tiny_drafter: DFlashDrafter) -> None:
    with serve(tiny_llama, tiny_drafter, max_concurrent=1, max_queue=1) as srv:
        admission = srv.app.state.server.admission
        _take_the_only_slot(srv)
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while queued and closes its connection
            httpx.post(srv.url + "/v1/completions", json=completion(), timeout=httpx.Timeout(30, read=0.5))
        _wait_for(lambda: admission.waiting == 0)
        assert metric(srv, 'dflash_requests_total{endpoint="completions",status="499"}') == 1
        result: list[httpx.Response] = []
        queued = threading.Thread(target=lambda: result.append(
            httpx.post(srv.url + "/v1/completions", json=completion(temperature=0), timeout=30)))
        queued.start()  # the freed place takes another request, which runs once the slot is back
        _wait_for(lambda: admission.waiting == 1)
        srv.loop.call_soon_threadsafe(admission.release)
        queued.join(30)
        assert result[0].status_code == 200


def test_a_queue_wait_past_its_limit_gets_503_with_retry_after(tiny_llama: LoadedModel,
                                                               tiny_drafter: DFlashDrafter) -> None:
    with serve(tiny_llama, tiny_drafter, max_concurrent=1, max_queue=4, queue_timeout_s=0.3) as srv:
        _take_the_only_slot(srv)
        start = time.perf_counter()
        r = httpx.post(srv.url + "/v1/completions", json=completion(), timeout=30)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        assert 0.3 <= time.perf_counter() - start < 5
        assert srv.app.state.server.admission.waiting == 0


# ------------------------------------------------------------------ shutdown of a real server process


class ServeProcess:
    """``python -m runtime.serve`` on the default model and drafter, in a process of its own (signals are real).

    The real model decodes slowly enough on the CPU (tens of tokens/s) that a stream outlasts a short drain."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "runtime.serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(command, cwd=Path(__file__).parents[1], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def __enter__(self) -> ServeProcess:
        deadline = time.time() + 180
        while True:
            assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
            assert time.time() < deadline, "the server never became ready"
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def open_stream(self) -> tuple[httpx.Client, Any]:
        """A long stream, its first chunk read."""
        client = httpx.Client(timeout=120)
        model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Write a long story about a fox."}],
                "max_tokens": 400, "temperature": 0, "stream": True}
        response = client.send(client.build_request("POST", self.url + "/v1/chat/completions", json=body), stream=True)
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        return client, lines


@pytest.fixture()
def default_model_installed(smollm2: LoadedModel) -> None:
    """Skips where the default model is not installed (the smollm2 fixture says so)."""


@pytest.mark.usefixtures("default_model_installed")
def test_sigterm_drains_then_ends_open_streams_with_an_error_event_and_exits() -> None:
    with ServeProcess("--drain-timeout", "1") as srv:
        client, lines = srv.open_stream()
        start = time.perf_counter()
        srv.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
        ended = time.perf_counter() - start
        client.close()
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["type"] == "server_unavailable" and "shut down" in error["message"]
        assert 1.0 <= ended < 10, ended
        srv.proc.wait(30)


@pytest.mark.usefixtures("default_model_installed")
def test_a_second_sigterm_exits_at_once() -> None:
    with ServeProcess("--drain-timeout", "120") as srv:
        client, _ = srv.open_stream()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert srv.proc.poll() is None  # draining: the stream may still finish
        start = time.perf_counter()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(15)
        client.close()
        assert time.perf_counter() - start < 15
