"""The HTTP server: a real uvicorn server in a thread, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import httpx
import openai
import pytest

from protocol import GenerationParams
from runtime.engine import Engine
from runtime.loading import LoadedModel
from runtime.models.dflash import DFlashDrafter
from runtime.server import ServerSettings, create_app

from .servers import HealthWatch, ServerThread, metric

MODEL = "tiny"
CHAT = [[{"role": "user", "content": f"Hello number {i}, tell me about foxes."}] for i in range(16)]
TEXT = [f"The quick brown fox {i}" for i in range(8)]


async def _direct(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> dict[str, list[str]]:
    async with Engine(tiny_llama, tiny_drafter) as engine:
        async def text(prompt: Any, n: int) -> str:
            return "".join([e.text async for e in engine.generate(prompt, GenerationParams(max_tokens=n))])
        return {"chat": [await text(p, 24) for p in CHAT], "text": [await text(p, 24) for p in TEXT]}


@pytest.fixture(scope="module")
def direct(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> dict[str, list[str]]:
    """What the engine gives directly (computed before the server thread exists)."""
    return anyio.run(_direct, tiny_llama, tiny_drafter)


@pytest.fixture(scope="module")
def server(direct: Any, tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> Iterator[ServerThread]:
    app = create_app(Engine(tiny_llama, tiny_drafter), ServerSettings(model_name=MODEL, max_concurrent=16, max_queue=16,
                                                                      allowed_hosts=["127.0.0.1"],
                                                                      enable_internal_stats=True))
    with ServerThread(app) as running:
        yield running


@pytest.fixture()
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)


def test_health_models_and_metrics(server: ServerThread) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    models = openai.OpenAI(base_url=server.url + "/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == [MODEL]
    text = httpx.get(server.url + "/metrics").text
    for name in ("dflash_requests_total", "dflash_generated_tokens_total", "dflash_time_to_first_token_seconds",
                 "dflash_acceptance_length", "dflash_running_requests", "dflash_queue_depth", "dflash_rounds_total"):
        assert name in text


def test_vllm_named_metrics_count_what_was_served(server: ServerThread, client: openai.OpenAI) -> None:
    """vLLM's series names and label, so its dashboards and autoscalers read this server."""
    label = f'{{model_name="{MODEL}"}}'
    before = {name: metric(server, name + label) for name in (
        "vllm:generation_tokens_total", "vllm:spec_decode_num_drafts_total", "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count", "vllm:inter_token_latency_seconds_count")}
    out = client.completions.create(model=MODEL, prompt=TEXT[2], max_tokens=20, temperature=0)
    after = {name: metric(server, name + label) for name in before}
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == out.usage.completion_tokens
    assert after["vllm:spec_decode_num_drafts_total"] > before["vllm:spec_decode_num_drafts_total"]
    assert after["vllm:time_to_first_token_seconds_count"] == before["vllm:time_to_first_token_seconds_count"] + 1
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"] + 1
    assert after["vllm:inter_token_latency_seconds_count"] > before["vllm:inter_token_latency_seconds_count"]
    drafted, accepted = metric(server, "vllm:spec_decode_num_draft_tokens_total" + label), \
        metric(server, "vllm:spec_decode_num_accepted_tokens_total" + label)
    per_position = metric(server, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert 0 <= accepted <= drafted and per_position == accepted
    assert metric(server, "vllm:num_requests_running" + label) == 0
    assert metric(server, "vllm:num_requests_waiting" + label) == 0


def test_greedy_chat_and_completions_equal_the_engine(client: openai.OpenAI, direct: dict[str, list[str]]) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=CHAT[0], max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == direct["chat"][0]
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens > 0 and chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    comp = client.completions.create(model=MODEL, prompt=TEXT[0], max_tokens=24, temperature=0)
    assert comp.choices[0].text == direct["text"][0]
    assert comp.usage is not None and comp.usage.completion_tokens > 0


def test_streaming_with_usage(client: openai.OpenAI, direct: dict[str, list[str]]) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT[1], max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct["chat"][1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    plain = list(client.completions.create(model=MODEL, prompt=TEXT[1], max_tokens=24, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in plain) == direct["text"][1]
    assert all(c.usage is None for c in plain)


def test_stop_sequences(client: openai.OpenAI, direct: dict[str, list[str]]) -> None:
    full = direct["text"][2]
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip())
    out = client.completions.create(model=MODEL, prompt=TEXT[2], max_tokens=24, temperature=0, stop=[stop, "\x00zz"])
    assert out.choices[0].text == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT[2], max_tokens=24, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[:full.index(stop)]


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    runs = [client.completions.create(model=MODEL, prompt=TEXT[3], max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
            .choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 99}, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [""]}, "stop"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"model": MODEL, "messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 600}]}, "messages"),
])
def test_bad_requests_get_400_naming_the_field(server: ServerThread, body: dict[str, Any], param: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_bad_requests_through_the_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x")
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert info.value.body["param"] == "temperature"


def test_malformed_json_and_non_objects(server: ServerThread) -> None:
    for raw in (b"{not json", b"[1, 2]", b"", b'"text"'):
        r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (raw, r.text)


def test_sixteen_concurrent_clients_get_their_one_at_a_time_outputs_in_shared_forwards(server: ServerThread, direct: dict[str, list[str]]) -> None:
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)

        async def one(i: int) -> str:
            if i % 2:
                stream = await client.chat.completions.create(model=MODEL, messages=CHAT[i], max_tokens=24,
                                                              temperature=0, stream=True)
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            out = await client.chat.completions.create(model=MODEL, messages=CHAT[i], max_tokens=24, temperature=0)
            return out.choices[0].message.content

        async with client:
            return list(await asyncio.gather(*(one(i) for i in range(16))))

    batched_before = metric(server, "dflash_batch_size_count") - metric(server, 'dflash_batch_size_bucket{le="1.0"}')
    assert asyncio.run(main()) == direct["chat"]
    batched = metric(server, "dflash_batch_size_count") - metric(server, 'dflash_batch_size_bucket{le="1.0"}')
    assert batched > batched_before, "no request shared its forwards with another"



def _wait_idle(server: ServerThread) -> dict[str, Any]:
    deadline = time.time() + 10
    while True:
        stats = httpx.get(server.url + "/v1/internal/stats").json()
        if (stats["running"] == 0 and stats["engine"]["live_requests"] == 0) or time.time() > deadline:
            return stats
        time.sleep(0.02)


def test_disconnect_mid_stream_cancels_the_request(server: ServerThread) -> None:
    before = metric(server, "dflash_finished_requests_total{reason=\"cancelled\"}")
    body = {"model": MODEL, "prompt": TEXT[4], "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(line.startswith("data: ") for line in got)
        running = httpx.get(server.url + "/v1/internal/stats").json()["running"]
        assert running == 1
    stats = _wait_idle(server)  # the connection is closed: the request must end at once
    assert stats["running"] == 0 and stats["engine"]["live_requests"] == 0 and stats["engine"]["cache_bytes"] == 0
    assert metric(server, "dflash_running_requests") == 0
    assert metric(server, "dflash_finished_requests_total{reason=\"cancelled\"}") == before + 1


def test_overload_gives_429_and_draining_gives_503(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> None:
    app = create_app(Engine(tiny_llama, tiny_drafter), ServerSettings(model_name=MODEL, max_concurrent=1, max_queue=0,
                                                                      warmup=False, enable_internal_stats=True))
    with ServerThread(app) as srv:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "temperature": 0}
        admission = app.state.server.admission
        asyncio.run_coroutine_threadsafe(admission.acquire(), srv.loop).result(5)  # the one slot is taken
        busy = httpx.post(srv.url + "/v1/completions", json=body)
        assert busy.status_code == 429 and busy.headers["retry-after"] and busy.json()["error"]["type"] == "rate_limit_error"
        assert metric(srv, 'dflash_requests_total{endpoint="completions",status="429"}') == 1
        srv.loop.call_soon_threadsafe(admission.release)
        assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 200
        _wait_idle(srv)
        srv.loop.call_soon_threadsafe(setattr, app.state.server.admission, "draining", True)
        time.sleep(0.05)
        closing = httpx.post(srv.url + "/v1/completions", json={**body, "stream": False})
        assert closing.status_code == 503 and closing.headers["retry-after"]
        assert httpx.get(srv.url + "/health").status_code == 503


EXTREME_VALUES: list[Any] = [None, 0, -1, 1.5, -0.0, 1e-40, 5e-324, 1e308, float("nan"), float("inf"), 2**63, -2**63,
                              10**30, "", "x" * 5000, "\u0000\ud7ff\U0001f98a", [], {}, [1, "a"], True, {"a": 1},
                              [{"role": "user"}], [0] * 3000, [-1], [49152], [[[[[[[[[[]]]]]]]]]], {"include_usage": 1}]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stream", "stream_options", "n", "block_size", "logprobs", "echo", "best_of", "suffix", "tools"]


def _malformed_request(rng: random.Random, http: httpx.Client) -> tuple[Any, httpx.Response]:
    """One request of a random kind: garbage bytes, wrong types and extreme values, wrong headers or methods."""
    path = rng.choice(["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/x" * 30, "/nope"])
    kind = rng.random()
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3}
    body["messages" if "chat" in path else "prompt"] = [{"role": "user", "content": "hi"}] if "chat" in path else "hi"
    if kind < 0.15:
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(60)))
        return raw, http.post(path, content=raw, headers={"content-type": "application/json"})
    if kind < 0.2:
        return "wrong content type", http.post(path, content=json.dumps(body), headers={
            "content-type": rng.choice(["text/plain", "application/x-www-form-urlencoded", ""])})
    if kind < 0.23:
        return "wrong host", http.post(path, json=body, headers={"host": "rebound.example"})
    if kind < 0.26:
        return "wrong method", http.request(rng.choice(["GET", "PUT", "DELETE", "PATCH"]), path)
    if kind < 0.28:
        return "over the body limit", http.post(path, content=b"{" + b" " * (5 * 1024 * 1024),
                                                 headers={"content-type": "application/json"})
    for name in rng.sample(FIELDS, rng.randrange(1, 5)):
        body[name] = rng.choice(EXTREME_VALUES)
    return body, http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def test_a_thousand_malformed_and_extreme_requests_get_only_4xx_and_health_stays_fast(
        server: ServerThread, client: openai.OpenAI, direct: dict[str, list[str]]) -> None:
    def send_many(seed: int) -> list[tuple[Any, int, str]]:
        rng = random.Random(seed)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            results = []
            for _ in range(300):
                sent, r = _malformed_request(rng, http)
                if r.status_code != 200 and r.headers.get("content-type", "").startswith("application/json"):
                    assert "error" in r.json(), r.text
                results.append((sent, r.status_code, r.text[:200]))
            return results

    with HealthWatch(server.url) as health, ThreadPoolExecutor(4) as pool:
        results = [item for batch in pool.map(send_many, range(4)) for item in batch]
    statuses = Counter(status for _, status, _ in results)
    assert len(results) >= 1000 and statuses[200] > 0
    server_errors = [(str(sent)[:200], status, text) for sent, status, text in results if status >= 500]
    assert not server_errors, server_errors[:5]
    assert all(400 <= s < 500 for s in statuses if s != 200), statuses
    health.assert_always_fast(min_probes=20)
    assert _wait_idle(server)["engine"]["live_requests"] == 0
    out = client.chat.completions.create(model=MODEL, messages=CHAT[0], max_tokens=24, temperature=0)
    assert out.choices[0].message.content == direct["chat"][0]


def test_shutdown_lets_a_running_stream_finish(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> None:
    app = create_app(Engine(tiny_llama, tiny_drafter), ServerSettings(model_name=MODEL, warmup=False))
    srv = ServerThread(app).__enter__()
    body = {"model": MODEL, "prompt": TEXT[5], "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        srv.server.should_exit = True  # uvicorn stops listening; the lifespan then drains and stops the engine
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")
    srv.thread.join(30)
    assert not srv.thread.is_alive()
    assert app.state.server.admission.draining and app.state.server.admission.running == 0


def test_loadtest_measures_a_live_server_at_each_concurrency(server: ServerThread, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from runtime.loadtest import load_test, parse_args

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHAT[:4]))
    args = parse_args(["--url", server.url, "--prompts", str(prompts), "--concurrency", "1", "3", "--max-tokens", "8"])
    levels = anyio.run(load_test, args)
    assert [level["concurrency"] for level in levels] == [1, 3]
    for level in levels:
        assert level["requests"] == 2 * level["concurrency"] and level["errors"] == 0
        assert 0 < level["completion_tokens"] <= 8 * level["requests"] and level["tokens_per_s"] > 0


def test_warm_up_runs_batched_steps_when_batches_are_padded(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter,
                                                            tmp_path: Any) -> None:
    from protocol import records
    from protocol.records import RoundRecord

    log = tmp_path / "warm.jsonl"
    engine = Engine(tiny_llama, tiny_drafter, pad_batches=True, log=log)
    with ServerThread(create_app(engine, ServerSettings(model_name=MODEL, max_concurrent=4))) as srv:
        deadline = time.time() + 30
        while httpx.get(srv.url + "/health").status_code != 200:
            assert time.time() < deadline, "never became ready"
            time.sleep(0.05)
        logged = map(records.from_json, log.read_text().splitlines())
        sizes = {r.batch_size for r in logged if isinstance(r, RoundRecord)}
    assert max(sizes) >= 2, f"warm-up never batched: {sizes}"


def test_warm_up_traces_compiled_steps_at_each_buffer_size(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> None:
    tiny_llama.model.compile_steps = tiny_drafter.compile_steps = True
    try:
        engine = Engine(tiny_llama, tiny_drafter)
        with ServerThread(create_app(engine, ServerSettings(model_name=MODEL, max_concurrent=2))) as srv:
            deadline = time.time() + 60
            while httpx.get(srv.url + "/health").status_code != 200:
                assert time.time() < deadline, "never became ready"
                time.sleep(0.05)
        # the tiny model's 512 positions hold two buffer sizes: both were traced before clients came
        assert {extent for extent, _ in tiny_llama.model._steps._steps} >= {256, 512}
    finally:
        tiny_llama.model.compile_steps = tiny_drafter.compile_steps = False
