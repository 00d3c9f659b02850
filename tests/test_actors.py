"""The actors' boundaries: no actor imports another, one schedule per mode, and every
mode commits the same tokens (greedy and sampled, alone and batched)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from actors.mailbox import Actor, Inbox, make_inbox
from actors.schedule import MODES, Schedule
from protocol import Cancelled, GenerationParams
from runtime.engine import Engine
from runtime.loading import LoadedModel
from runtime.models.dflash import DFlashDrafter

from .test_engine import PROMPTS, collect

ACTORS = Path(__file__).resolve().parent.parent / "actors"
ACTOR_MODULES = {"committer", "drafter", "verifier"}


def imported(path: Path) -> set[str]:
    """The ``actors`` modules a module of the package imports (relative or absolute, TYPE_CHECKING too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
            elif node.module and node.module.split(".")[0] == "actors":
                rest = node.module.split(".")[1:]
                names |= {rest[0]} if rest else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("actors.")}
    return names


def test_no_actor_module_imports_another_and_the_package_has_no_import_cycle() -> None:
    modules = {p.stem: imported(p) for p in ACTORS.glob("*.py") if p.stem != "__init__"}
    assert ACTOR_MODULES <= set(modules)
    for name in ACTOR_MODULES:
        assert not modules[name] & ACTOR_MODULES, (name, modules[name])

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join(path + (name,))}"
        for dep in modules.get(name, ()):
            visit(dep, path + (name,))

    for name in modules:
        visit(name, ())


def test_no_actor_holds_another_actor(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> None:
    """Actors are wired with streams and round readers only."""
    from actors.mailbox import Actor

    async def main() -> None:
        async with Engine(tiny_llama, tiny_drafter) as engine:
            actors = engine._running_actors()
            for actor in (actors.drafter, actors.verifier, actors.committer):
                for name, value in vars(actor).items():
                    values = value if isinstance(value, (list, tuple)) else [value]
                    assert not any(isinstance(v, Actor) for v in values), (actor.name, name)

    anyio.run(main)


def test_the_schedule_of_each_mode() -> None:
    assert MODES == {"pipelined": Schedule(1), "sequential": Schedule(0), "pipelined2": Schedule(2),
                     "draft-ahead": Schedule(1, verify_after_commit=True)}
    pipelined, sequential = MODES["pipelined"], MODES["sequential"]
    assert sequential.may_commit(3, drafted=3, generated=5, max_tokens=64)
    assert not pipelined.may_commit(3, drafted=3, generated=5, max_tokens=64)  # round 4 is not queued yet
    assert pipelined.may_commit(3, drafted=4, generated=5, max_tokens=64)
    assert pipelined.may_commit(3, drafted=3, generated=63, max_tokens=64)  # round 4 will never be drafted
    assert not MODES["pipelined2"].may_commit(3, drafted=4, generated=5, max_tokens=64)
    assert MODES["draft-ahead"].verify_step({"a": 4, "b": 4}, {"a": 3, "b": 3})
    assert not MODES["draft-ahead"].verify_step({"a": 4, "b": 4}, {"a": 3, "b": 2})  # all or none
    assert pipelined.verify_step({"a": 4, "b": 4}, {"a": 1, "b": 2})


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_mode_commits_the_same_tokens_alone_and_batched(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter,
                                                              temperature: float) -> None:
    def params(i: int) -> GenerationParams:
        return GenerationParams(max_tokens=6 + 5 * i, block_size=3 + i, temperature=temperature, seed=i)

    async def outputs(mode: str) -> Any:
        got: dict[Any, list[int]] = {}
        async with Engine(tiny_llama, tiny_drafter, mode=mode) as engine:
            for i in range(3):
                got["alone", i] = (await collect(engine, PROMPTS[10 + i], params(i)))[0]

            async def one(i: int) -> None:
                got["batched", i] = (await collect(engine, PROMPTS[10 + i], params(i)))[0]

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(one, i)
            stats = await engine.stats()
        assert stats.live_requests == 0 and stats.cache_bytes == 0
        return got

    results = {mode: anyio.run(outputs, mode) for mode in MODES}
    want = results["sequential"]
    for mode, got in results.items():
        assert got == want, mode


def test_an_actor_handles_the_messages_waiting_in_its_inbox_in_one_go_then_flushes() -> None:
    """Messages already waiting are read without a trip through the event loop each (a batched
    round brings several per request), and the flush comes once, after all of them."""
    class Counting(Actor):
        def __init__(self, inbox: Inbox) -> None:
            super().__init__(inbox)
            self.flushed_after: list[int] = []

        async def handle(self, message: Any) -> None:
            pass

        async def flush(self) -> None:
            self.flushed_after.append(self.handled)

    seen: list[int] = []

    async def main() -> None:
        send, receive = make_inbox()
        actor = Counting(receive)
        for i in range(10):
            send.send_nowait(Cancelled(request_id=f"r{i}"))

        async def watch() -> None:  # what another task sees whenever it gets the loop
            for _ in range(30):
                seen.append(actor.handled)
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(actor.run)
            tg.start_soon(watch)
            await anyio.sleep(0.05)
            send.close()
        assert actor.flushed_after == [10]

    anyio.run(main)
    assert set(seen) <= {0, 10}, seen
