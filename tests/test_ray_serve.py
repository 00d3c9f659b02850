"""The Ray Serve application (runtime.server.ray_app): a local Ray, two replicas of the real default model
behind Ray Serve's HTTP proxy on loopback, driven concurrently by the official openai client."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import httpx
import openai
import pytest

from runtime.engine import Engine

from .servers import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

# after the skip: it imports ray
from runtime.server.ray_app import REPLICA_HEADER, build_app

pytestmark = pytest.mark.slow  # 50-80 s on 2 cores: Ray's start, two replicas loading and warming up

API_KEY = "ray-serve-test-key"
MAX_TOKENS = 16
QUESTIONS = ("What is the capital of France?", "Name three colours.", "What is 7*6?", "Say hello in Spanish.")
PROMPTS = [[{"role": "user", "content": q}] for q in QUESTIONS]


async def _alone() -> list[str]:
    async with Engine.load() as engine:  # the default model and drafter, as each replica loads them
        texts = []
        for prompt in PROMPTS:
            texts.append("".join([e.text async for e in engine.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0)]))
        return texts


@pytest.fixture(scope="module")
def alone() -> list[str]:
    """Each prompt's greedy output from one engine, one request at a time (computed before Ray starts)."""
    return anyio.run(_alone)


@pytest.fixture(scope="module")
def url(alone: list[str]) -> Iterator[str]:
    port = free_port()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no report to send from a test
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"num_replicas": "2", "num_cpus": "1", "api_key": API_KEY}), name="dflash",
                  route_prefix="/")  # returns once both replicas have loaded and warmed up
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _ask(client: openai.OpenAI, model: str, prompt: list[dict[str, str]], stream: bool) -> tuple[str, str]:
    """The answer's text, and the replica that served it."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=stream)
    out: Any = raw.parse()
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in out if c.choices)
    else:
        text = out.choices[0].message.content
    return text, raw.headers[REPLICA_HEADER]


def test_two_replicas_share_concurrent_requests_and_answer_as_one_engine(url: str, alone: list[str]) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    jobs = [(i, stream) for i in range(len(PROMPTS)) for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: _ask(client, model, PROMPTS[job[0]], job[1]), jobs))
    assert [text for text, _ in answers] == [alone[i] for i, _ in jobs]
    served = {replica for _, replica in answers}
    assert len(served) == 2, served  # both replicas took requests


def test_the_api_key_guards_v1_and_probes_stay_open(url: str) -> None:
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.headers[REPLICA_HEADER]
    assert "vllm:num_requests_waiting" in httpx.get(url + "/metrics").text
