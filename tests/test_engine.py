"""The actor pipeline: pipelined, sequential and plain decoding agree; failures stay local."""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest

from actors.rounds import RoundOutputs, RoundReader
from actors.verifier import Verifier
from protocol import GenerationParams, TokenEvent
from runtime.engine import Engine
from runtime.loading import LoadedModel
from runtime.models.dflash import DFlashDrafter
from runtime.plain import generate_plain, run_to_end

PROMPTS = [[random.Random(i).randrange(3, 320) for _ in range(random.Random(i).randrange(2, 25))] for i in range(50)]


def plain(target: LoadedModel, prompt: list[int], params: GenerationParams) -> list[int]:
    return run_to_end(generate_plain(target.model, target.tokenizer, prompt, params), len(prompt)).token_ids


async def collect(engine: Engine, prompt: Any, params: GenerationParams) -> tuple[list[int], TokenEvent]:
    ids: list[int] = []
    last = None
    async for event in engine.generate(prompt, params):
        ids += event.token_ids
        last = event
    assert last is not None and last.finish_reason is not None
    return ids, last


def run(fn: Any, backend: str = "asyncio") -> Any:
    return anyio.run(fn, backend=backend)


@pytest.mark.parametrize("block", [2, 5, 16])
def test_pipelined_sequential_and_plain_greedy_outputs_are_identical(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter, block: int) -> None:
    async def outputs(mode: str) -> list[list[int]]:
        async with Engine(tiny_llama, tiny_drafter, mode=mode) as engine:
            return [(await collect(engine, p, GenerationParams(max_tokens=7 + 3 * i, block_size=block)))[0]
                    for i, p in enumerate(PROMPTS[:8])]

    want = [plain(tiny_llama, p, GenerationParams(max_tokens=7 + 3 * i)) for i, p in enumerate(PROMPTS[:8])]
    assert run(lambda: outputs("sequential")) == want
    assert run(lambda: outputs("pipelined")) == want
    assert run(lambda: outputs("pipelined2")) == want
    assert run(lambda: outputs("draft-ahead")) == want


@pytest.mark.parametrize("backend,mode", [("asyncio", "pipelined"), ("trio", "pipelined"), ("asyncio", "pipelined2"),
                                          ("trio", "draft-ahead")])
def test_fifty_concurrent_generations_finish_correctly_and_leave_no_state(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter,
                                                                          backend: str, mode: str) -> None:
    results: dict[int, list[int]] = {}

    async def main() -> Any:
        async with Engine(tiny_llama, tiny_drafter, mode=mode) as engine:
            async def one(i: int) -> None:
                results[i] = (await collect(engine, PROMPTS[i], GenerationParams(max_tokens=12, block_size=4)))[0]

            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(one, i)
            return await engine.stats()

    stats = run(main, backend)
    assert stats.live_requests == 0 and stats.cache_bytes == 0
    for i in range(50):
        assert results[i] == plain(tiny_llama, PROMPTS[i], GenerationParams(max_tokens=12))


def test_leaving_the_loop_mid_request_cancels_it_and_frees_its_state(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> None:
    async def main() -> Any:
        async with Engine(tiny_llama, tiny_drafter) as engine:
            seen = 0
            async for event in engine.generate(PROMPTS[0], GenerationParams(max_tokens=200, block_size=4)):
                seen += len(event.token_ids)
                if seen >= 5:
                    break
            await anyio.sleep(0.01)  # the abandoned generator is closed by the event loop
            during = await engine.stats()
            ids, _ = await collect(engine, PROMPTS[1], GenerationParams(max_tokens=10))  # still serving
            with anyio.move_on_after(0.02):  # a cancelled scope ends its request too
                await collect(engine, PROMPTS[2], GenerationParams(max_tokens=400))
            return during, ids, await engine.stats()

    during, ids, after = run(main)
    assert during.live_requests == 0 and during.cache_bytes == 0
    assert ids == plain(tiny_llama, PROMPTS[1], GenerationParams(max_tokens=10))
    assert after.live_requests == 0 and after.cache_bytes == 0


class CorruptedRound:
    """A round's verifier outputs as the committer reads them, lying in one way."""

    def __init__(self, out: RoundOutputs, kind: str) -> None:
        self.out, self.kind = out, kind

    def host(self) -> Any:
        row = self.out.host()
        if self.kind == "lag":
            return row._replace(kv_before=row.kv_before + 1)
        if self.kind == "trim":
            return row._replace(kv_after=row.kv_after + 2)
        if self.kind == "accepted-prefix":
            return row._replace(accepted=row.accepted + 1)
        return row

    @property
    def tap_shape(self) -> tuple[int, ...]:
        rows, features = self.out.tap_shape
        return (rows, features - 1) if self.kind == "layout" else (rows, features)


class CorruptingView:
    """What the committer reads of the verifier, with one request's round 2 corrupted."""

    def __init__(self, verifier: RoundReader[RoundOutputs], victim: str, kind: str) -> None:
        self.verifier, self.victim, self.kind = verifier, victim, kind

    def get(self, request_id: str, round: int) -> Any:
        out = self.verifier.get(request_id, round)
        return CorruptedRound(out, self.kind) if (request_id, round) == (self.victim, 2) else out


class RolledBackDraft:
    """A round's drafter outputs claiming the round started from a shrunk context."""

    def __init__(self, out: Any) -> None:
        self.out = out

    def host(self) -> Any:
        row = self.out.host()
        return row._replace(ctx_before=row.ctx_before - 1)


class RollingBackDrafterView:
    """The committer's view of the drafter, claiming round 2 started from a shrunk context."""

    def __init__(self, drafter: Any, victim: str) -> None:
        self.drafter, self.victim = drafter, victim

    def get(self, request_id: str, round: int) -> Any:
        out = self.drafter.get(request_id, round)
        return RolledBackDraft(out) if (request_id, round) == (self.victim, 2) else out


@pytest.mark.parametrize("mode", ["pipelined", "pipelined2"])
@pytest.mark.parametrize("kind,error", [("lag", "LagViolation"), ("trim", "TrimViolation"), ("layout", "LayoutViolation"),
                                        ("accepted-prefix", "AcceptanceViolation"), ("no-rollback", "RollbackViolation")])
def test_a_corrupted_verdict_ends_only_its_request_with_the_named_error(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter, kind: str,
                                                                          error: str, mode: str) -> None:
    params = GenerationParams(max_tokens=20, block_size=4)

    async def main() -> Any:
        async with Engine(tiny_llama, tiny_drafter, mode=mode) as engine:
            committer = engine._running_actors().committer
            if kind == "no-rollback":
                committer.drafts = RollingBackDrafterView(committer.drafts, "req-0")
            else:
                committer.verified = CorruptingView(committer.verified, "req-0", kind)
            outcomes: dict[int, Any] = {}

            async def one(i: int) -> None:
                outcomes[i] = await collect(engine, PROMPTS[i], params)

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(one, i)
            return outcomes, await engine.stats()

    outcomes, stats = run(main)
    _, last = outcomes[0]
    assert last.finish_reason == "error" and f"{kind} invariant violated" in (last.error or "")
    for i in (1, 2):
        assert outcomes[i][0] == plain(tiny_llama, PROMPTS[i], params)
    assert stats.live_requests == 0


def test_round_logs_record_every_round_and_rebuild_the_output(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from protocol import records

    log = tmp_path / "run.jsonl"

    async def main() -> list[int]:
        async with Engine(tiny_llama, tiny_drafter, log=log) as engine:
            return (await collect(engine, PROMPTS[4], GenerationParams(max_tokens=15, block_size=4)))[0]

    ids = run(main)
    parsed = [records.from_json(line) for line in log.read_text().splitlines()]
    kinds = [type(r).__name__ for r in parsed]
    assert kinds[0] == "RequestRecord" and kinds[-1] == "FinishRecord"
    rounds = [r for r in parsed if type(r).__name__ == "RoundRecord"]
    first = ids[0]
    assert [first] + [t for r in rounds for t in r.committed][: len(ids) - 1] == ids
    assert all(r.verify_queued >= r.draft_queued for r in rounds)
    assert parsed[-1].token_ids == ids


def test_seeded_sampling_gives_the_same_output_in_both_modes(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> None:
    params = GenerationParams(max_tokens=24, temperature=1.5, top_p=0.95, seed=7, block_size=4)

    async def outputs(mode: str) -> list[list[int]]:
        async with Engine(tiny_llama, tiny_drafter, mode=mode) as engine:
            return [(await collect(engine, p, params))[0] for p in PROMPTS[:4]]

    sequential = run(lambda: outputs("sequential"))
    assert run(lambda: outputs("pipelined")) == sequential
    assert run(lambda: outputs("pipelined2")) == sequential
    assert run(lambda: outputs("draft-ahead")) == sequential
    assert run(lambda: outputs("sequential")) == sequential  # and reproducible


def _run_concurrently(engine: Engine, prompts: list[list[int]], params: list[GenerationParams]) -> Any:
    """All prompts at once on the engine; each must finish without an error, and none may hang."""
    async def main() -> dict[int, list[int]]:
        results: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            ids, last = await collect(engine, prompts[i], params[i])
            assert last.finish_reason != "error", last.error
            results[i] = ids

        with anyio.fail_after(120):
            async with engine, anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
        return results

    return main


@pytest.mark.parametrize("mode,pad", [("pipelined", False), ("sequential", False), ("pipelined", True), ("pipelined2", True),
                                      ("draft-ahead", True)])
def test_concurrent_requests_share_forwards_and_each_gets_its_alone_output(
        tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter, mode: str, pad: bool, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from protocol import records

    # different block sizes, limits that end mid-block, prompts of different lengths; with pad,
    # steps run at power-of-two row counts (as on a GPU) and the blank rows must change nothing
    params = [GenerationParams(max_tokens=9 + 3 * (i % 5), block_size=2 + i % 7) for i in range(12)]
    log = tmp_path / "rounds.jsonl"
    engine = Engine(tiny_llama, tiny_drafter, mode=mode, log=log, pad_batches=pad)
    results = run(_run_concurrently(engine, PROMPTS[:12], params))
    for i in range(12):
        assert results[i] == plain(tiny_llama, PROMPTS[i], params[i])
    sizes = [r.batch_size for r in map(records.from_json, log.read_text().splitlines()) if type(r).__name__ == "RoundRecord"]
    assert max(sizes) >= 8, f"rounds were not batched: batch sizes {sorted(set(sizes))}"
    assert sum(sizes) / len(sizes) >= 6, f"rounds fell apart into small batches: mean {sum(sizes) / len(sizes):.2f}"


@pytest.mark.parametrize("pad", [False, True])
def test_seeded_sampling_is_the_same_in_a_batch_as_alone(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter, pad: bool) -> None:
    sampled = [GenerationParams(max_tokens=16, temperature=1.2, seed=i, block_size=3 + i % 3) for i in range(6)]
    greedy = [GenerationParams(max_tokens=14, block_size=4)] * 4
    params = sampled + greedy
    prompts = PROMPTS[:10]
    together = run(_run_concurrently(Engine(tiny_llama, tiny_drafter, pad_batches=pad), prompts, params))
    for i in range(10):
        alone = run(_run_concurrently(Engine(tiny_llama, tiny_drafter), [prompts[i]], [params[i]]))
        assert together[i] == alone[0]


@pytest.mark.parametrize("mode", ["pipelined", "sequential", "pipelined2"])
def test_cancelling_one_batched_request_lets_the_others_finish(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter,
                                                                mode: str) -> None:
    params = GenerationParams(max_tokens=40, block_size=4)

    async def main() -> Any:
        results: dict[int, list[int]] = {}
        async with Engine(tiny_llama, tiny_drafter, mode=mode) as engine:
            async def one(i: int) -> None:
                ids: list[int] = []
                async for event in engine.generate(PROMPTS[i], params):
                    ids += event.token_ids
                    if i == 0 and len(ids) >= 6:
                        return  # leaves mid-request: cancelled while the others share its steps
                results[i] = ids

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for i in range(4):
                        tg.start_soon(one, i)
            return results, await engine.stats()

    results, stats = run(main)
    for i in (1, 2, 3):
        assert results[i] == plain(tiny_llama, PROMPTS[i], params)
    assert stats.live_requests == 0


def test_cancelling_at_any_point_of_admission_leaves_no_state_and_blocks_nobody(
        tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> None:
    """Cancelled after k scheduler turns, for many k: before, during and after the actors see its Admit."""
    params = GenerationParams(max_tokens=12, block_size=4)
    want = plain(tiny_llama, PROMPTS[6], params)

    async def main() -> Any:
        async with Engine(tiny_llama, tiny_drafter) as engine:
            for turns in range(12):
                doomed_scope = anyio.CancelScope()
                got: list[list[int]] = []

                async def doomed() -> None:
                    with doomed_scope:
                        async for _ in engine.generate(PROMPTS[5], GenerationParams(max_tokens=200, block_size=4)):
                            pass

                async def survivor() -> None:
                    got.append((await collect(engine, PROMPTS[6], params))[0])

                with anyio.fail_after(30):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(doomed)
                        tg.start_soon(survivor)
                        for _ in range(turns):
                            await anyio.sleep(0)
                        doomed_scope.cancel()
                assert got == [want], turns
                stats = await engine.stats()
                assert stats.live_requests == 0 and stats.cache_bytes == 0, turns

    run(main)


def test_a_request_cancelled_while_its_admit_is_still_queued_leaves_no_state(
        tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> None:
    from protocol import Admit

    async def main() -> Any:
        async with Engine(tiny_llama, tiny_drafter) as engine:
            admit = Admit(request_id="late", prompt_ids=PROMPTS[3], params=GenerationParams(max_tokens=8))
            for name in ("drafter", "verifier"):  # queued, not yet handled by either actor
                engine._running_actors().inboxes[name].send_nowait(admit)
            engine.cancel("late")
            with anyio.fail_after(30):  # a drafter still holding "late" would make the next request wait for it
                return await engine.stats(), (await collect(engine, PROMPTS[4], GenerationParams(max_tokens=8)))[0]

    stats, after = run(main)
    assert stats.live_requests == 0 and stats.cache_bytes == 0
    assert after == plain(tiny_llama, PROMPTS[4], GenerationParams(max_tokens=8))  # and nobody waits for it


def test_a_failed_batched_step_is_retried_per_request_from_the_same_state(
        tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first batched draft fails after newcomers' context went in: the retry must start from before it."""
    params = GenerationParams(max_tokens=16, block_size=4)
    real_hidden, failed = tiny_drafter.hidden, []

    def flaky_hidden(block: Any, *args: Any, **kwargs: Any) -> Any:
        if block.shape[0] > 1 and not failed:
            failed.append(block.shape[0])
            raise RuntimeError("injected failure of a batched draft")
        return real_hidden(block, *args, **kwargs)

    monkeypatch.setattr(tiny_drafter, "hidden", flaky_hidden)
    results = run(_run_concurrently(Engine(tiny_llama, tiny_drafter), PROMPTS[:4], [params] * 4))
    assert failed, "no batched draft happened"
    for i in range(4):
        assert results[i] == plain(tiny_llama, PROMPTS[i], params)


class FailsOnceOnAKeptStack:
    """Records the stack of each batched step; raises once, on a stack kept from the step before."""

    def __init__(self, what: str) -> None:
        self.what, self.failed_at = what, 0
        self.stacks: list[Any] = []

    def step(self, stack: Any) -> None:
        self.stacks.append(stack)  # kept alive, so identities stay unique
        if not self.failed_at and len(self.stacks) >= 3 and self.stacks[-1] is self.stacks[-2]:
            self.failed_at = len(self.stacks)
            raise RuntimeError(f"injected failure of a batched {self.what} on a kept stack, after its writes")

    def check_outputs(self, engine: Engine, tiny_llama: LoadedModel) -> None:
        """Every request's output is exact although one step failed, and steps ran on after it."""
        params = GenerationParams(max_tokens=30, block_size=3)
        results = run(_run_concurrently(engine, PROMPTS[:4], [params] * 4))
        assert self.failed_at and len(self.stacks) > self.failed_at, "no failure on a kept stack, or nothing after it"
        for i in range(4):
            assert results[i] == plain(tiny_llama, PROMPTS[i], params)


def test_a_failed_draft_on_a_kept_stack_is_retried_per_request_from_the_same_state(
        tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batched draft fails on a stack kept from the step before, after its context went in and its
    lengths advanced: the stack is restored and broken up, each request retries alone, outputs stay exact."""
    real_hidden, injected = tiny_drafter.hidden, FailsOnceOnAKeptStack("draft")

    def flaky_hidden(block: Any, ctx: Any, caches: Any, **kwargs: Any) -> Any:
        hidden = real_hidden(block, ctx, caches, **kwargs)
        if block.shape[0] > 1:
            injected.step(caches)
        return hidden

    monkeypatch.setattr(tiny_drafter, "hidden", flaky_hidden)
    injected.check_outputs(Engine(tiny_llama, tiny_drafter), tiny_llama)


@pytest.fixture()
def compiled_steps(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> Any:
    """Verify and draft forwards as compiled steps (the GPU default) for one test."""
    tiny_llama.model.compile_steps = tiny_drafter.compile_steps = True
    yield
    tiny_llama.model.compile_steps = tiny_drafter.compile_steps = False


@pytest.mark.parametrize("mode", ["pipelined", "sequential", "pipelined2"])
def test_compiled_steps_give_every_request_its_plain_greedy_output(
        tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter, compiled_steps: Any, mode: str) -> None:
    # alone (single-request steps) and concurrently (stacked caches, padded rows, shorter blocks)
    params = [GenerationParams(max_tokens=9 + 3 * (i % 5), block_size=2 + i % 7) for i in range(12)]
    want = [plain(tiny_llama, PROMPTS[i], params[i]) for i in range(12)]

    async def alone() -> list[list[int]]:
        async with Engine(tiny_llama, tiny_drafter, mode=mode) as engine:
            return [(await collect(engine, PROMPTS[i], params[i]))[0] for i in range(4)]

    assert run(alone) == want[:4]
    together = run(_run_concurrently(Engine(tiny_llama, tiny_drafter, mode=mode, pad_batches=True), PROMPTS[:12], params))
    assert [together[i] for i in range(12)] == want
    assert tiny_llama.model._steps._steps and tiny_drafter._steps._steps  # the compiled steps did run


def test_requests_joining_and_leaving_re_form_the_kept_stack_instead_of_rebuilding_it(
        tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter, monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.cache as cache

    built: list[int] = []  # rows of every stack built from the members' own buffers
    re_formed: list[int] = []
    real_stack_layers, real_regathered = cache.stack_layers, cache.StackedKVCache.regathered

    def stack_layers(requests: Any, new_rows: int, rows: int) -> Any:
        built.append(rows)
        return real_stack_layers(requests, new_rows, rows)

    def regathered(self: Any, members: Any, *args: Any) -> Any:
        re_formed.append(len(members))
        return real_regathered(self, members, *args)

    monkeypatch.setattr(cache, "stack_layers", stack_layers)
    monkeypatch.setattr(cache.StackedKVCache, "regathered", regathered)
    # staggered limits: requests leave one after another while the others keep decoding
    params = [GenerationParams(max_tokens=8 + 5 * i, block_size=3) for i in range(8)]
    engine = Engine(tiny_llama, tiny_drafter, pad_batches=True)
    results = run(_run_concurrently(engine, PROMPTS[:8], params))
    assert [results[i] for i in range(8)] == [plain(tiny_llama, PROMPTS[i], params[i]) for i in range(8)]
    layers = len(tiny_llama.model.model.layers)
    assert len(re_formed) >= 5 * layers, re_formed  # membership changed often...
    assert len(built) <= len(re_formed) // (2 * layers), (len(built), len(re_formed))  # ...and was mostly re-formed
    assert engine._actors is not None
    for actor in (engine._actors.verifier, engine._actors.drafter):
        assert actor._stack.layers is None and actor.cache_bytes == 0


def test_a_batch_keeps_its_stacked_caches_while_its_requests_stay_together(
        tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter, monkeypatch: pytest.MonkeyPatch) -> None:
    stacks: list[Any] = []  # the stack each batched verify ran on (kept alive, so identities stay unique)
    draft_stacks: list[Any] = []
    steps = []
    verify, real_hidden = Verifier._verify, tiny_drafter.hidden

    async def counted(self: Verifier, rounds: Any) -> None:
        steps.append(len(rounds))
        await verify(self, rounds)
        if len(rounds) > 1 and self._stack.layers is not None:
            stacks.append(self._stack.layers)

    def hidden(block: Any, ctx: Any, caches: Any, **kwargs: Any) -> Any:
        if block.shape[0] > 1:
            draft_stacks.append(caches)
        return real_hidden(block, ctx, caches, **kwargs)

    monkeypatch.setattr(Verifier, "_verify", counted)
    monkeypatch.setattr(tiny_drafter, "hidden", hidden)
    params = [GenerationParams(max_tokens=40, block_size=3) for _ in range(6)]
    engine = Engine(tiny_llama, tiny_drafter, pad_batches=True)
    results = run(_run_concurrently(engine, PROMPTS[:6], params))
    assert [results[i] for i in range(6)] == [plain(tiny_llama, PROMPTS[i], params[i]) for i in range(6)]
    batched = sum(n > 1 for n in steps)
    built = len({id(layers) for layers in stacks})
    assert batched >= 10 and built <= batched // 3, (built, batched)  # rebuilt only when membership changed
    drafted = len({id(layers) for layers in draft_stacks})
    assert len(draft_stacks) >= 10 and drafted <= len(draft_stacks) // 3, (drafted, len(draft_stacks))
    assert engine._actors is not None
    for actor in (engine._actors.verifier, engine._actors.drafter):  # released at the end
        assert actor._stack.layers is None and actor.cache_bytes == 0


def test_a_failed_verify_on_a_kept_stack_is_retried_per_request_from_the_same_state(
        tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batched verify fails on a stack kept from earlier steps, after its lengths advanced: the
    stack is restored and broken up, each request retries alone, and every output is still exact."""
    from runtime.cache import StackedKVCache

    real_advance, injected = StackedKVCache.advance, FailsOnceOnAKeptStack("verify")

    def flaky_advance(self: StackedKVCache, n: Any) -> None:
        real_advance(self, n)
        stack = engine._running_actors().verifier._stack.layers
        if stack is not None and self is stack[0]:
            injected.step(stack)

    monkeypatch.setattr(StackedKVCache, "advance", flaky_advance)
    engine = Engine(tiny_llama, tiny_drafter)
    injected.check_outputs(engine, tiny_llama)


def test_generate_takes_params_as_keywords_and_refuses_wrong_types_by_name(tiny_llama: LoadedModel,
                                                                         tiny_drafter: DFlashDrafter) -> None:
    async def main() -> None:
        async with Engine(tiny_llama, tiny_drafter) as engine:
            want = (await collect(engine, PROMPTS[0], GenerationParams(max_tokens=9, stop=("x",))))[0]
            got = [t async for e in engine.generate(PROMPTS[0], max_tokens=9, stop="x") for t in e.token_ids]
            assert got == want
            for params, fields, named in [({"max_tokens": 9}, {}, "GenerationParams"),
                                          (None, {"max_tokens": "nine"}, "max_tokens"),
                                          (None, {"temperature": [0.5]}, "temperature"),
                                          (None, {"max_token": 9}, "'max_token'")]:
                with pytest.raises(TypeError, match=named):
                    async for _ in engine.generate(PROMPTS[0], params, **fields):  # type: ignore[arg-type]
                        pass
            with pytest.raises(TypeError, match="prompt must be"):
                async for _ in engine.generate(42):  # type: ignore[arg-type]
                    pass
            assert (await engine.stats()).live_requests == 0

    run(main)
