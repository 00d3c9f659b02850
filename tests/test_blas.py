"""runtime.blas: the CPU's float32 matmuls run on an OpenBLAS proven safe on this CPU, or on the reference BLAS, saying why."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import runtime.blas as blas
from protocol import GenerationParams, RoundRecord, records
from runtime.defaults import default_drafter_path
from runtime.engine import Engine
from runtime.loading import LoadedModel, load_drafter
from runtime.plain import generate_plain, run_to_end

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS is preloaded on Linux only")
REFERENCE_NOTICE = "dflash-runtime: float32 CPU matmuls use the reference BLAS"


def picked(tmp_path: Path, first: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    """A fresh process's choice, with its own verdict cache (``tmp_path``): stdout is ``blas_in_use()``.
    ``first``: what the process imports before runtime."""
    code = f"{first}import runtime, runtime.blas as b; print(b.blas_in_use())"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "XDG_CACHE_HOME": str(tmp_path), **env},
                          capture_output=True, text=True, check=True)


def has_dist(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@linux_only
def test_reference_blas_when_asked_for_says_nothing(tmp_path: Path) -> None:
    done = picked(tmp_path, DFLASH_BLAS="reference")
    assert done.stdout.strip() == "reference" and REFERENCE_NOTICE not in done.stderr


@linux_only
@pytest.mark.skipif(not has_dist("ngsolve-openblas"), reason="the declared OpenBLAS wheel is not installed")
def test_the_declared_dynamic_arch_openblas_passes_its_probe_once_and_is_loaded(tmp_path: Path) -> None:
    first = picked(tmp_path)
    assert first.stdout.strip().endswith(".so") and "libopenblas" in first.stdout, first.stderr
    verdicts = json.loads((tmp_path / "dflash-runtime" / "blas-verdicts.json").read_text())
    assert [v["ok"] for v in verdicts.values()] == [True]
    # the cached verdict decides from now on: marked unsafe, the same library is refused without a probe
    (tmp_path / "dflash-runtime" / "blas-verdicts.json").write_text(json.dumps(
        {key: {**v, "ok": False, "why": "marked unsafe by the test"} for key, v in verdicts.items()}))
    second = picked(tmp_path)
    assert "ngsolve-openblas: marked unsafe by the test" in second.stderr
    assert second.stdout.strip() != first.stdout.strip()


@linux_only
def test_a_library_that_does_not_load_falls_back_to_the_reference_blas_and_says_so_once(tmp_path: Path) -> None:
    done = picked(tmp_path, DFLASH_BLAS=str(tmp_path / "libopenblas.so.0"))
    assert done.stdout.strip().startswith("reference (") and "does not load" in done.stdout
    assert done.stderr.count(REFERENCE_NOTICE) == 1 and "pip install ngsolve-openblas" in done.stderr
    assert not (tmp_path / "dflash-runtime" / "blas-verdicts.json").exists()  # a missing file may come: not cached


@linux_only
def test_mlx_imported_before_runtime_keeps_the_reference_blas_and_says_to_import_runtime_first(tmp_path: Path) -> None:
    done = picked(tmp_path, first="import mlx.core; ")
    assert done.stdout.strip().startswith("reference (") and "mlx was imported before runtime" in done.stdout
    assert done.stderr.count(REFERENCE_NOTICE) == 1 and "import runtime (or anything from it) before mlx" in done.stderr


@linux_only
@pytest.mark.skipif(not has_dist("cmeel-openblas"), reason="cmeel-openblas (a test dependency) is not installed")
def test_the_probe_refuses_an_openblas_built_for_avx512_exactly_where_the_cpu_lacks_it(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """cmeel-openblas 0.3.31 is built for SKYLAKEX: on a CPU without AVX-512 its sgemm dies of SIGILL (in the child)."""
    library = blas.with_fortran_runtime(blas.candidates()[-1].path)
    assert "cmeel" in os.path.realpath(library)
    # the child finds libgfortran.so.5 through the link folder (that library has no $ORIGIN path of its own)
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(library))
    verdict = blas.probe(library)
    assert verdict.final, verdict.why
    assert verdict.ok == ("avx512f" in cpu_flags()), verdict.why
    if not verdict.ok:
        assert "SIGILL" in verdict.why


@linux_only
@pytest.mark.skipif(not has_dist("ngsolve-openblas"), reason="the declared OpenBLAS wheel is not installed")
def test_this_process_runs_on_a_probed_openblas() -> None:
    """The install's choice is the one the rest of the suite (and the engine test below) runs on."""
    assert blas.loaded_blas is not None, blas.blas_in_use()
    assert blas.cached_probe(blas.loaded_blas).ok


def test_batched_rounds_after_a_long_prefill_equal_plain_greedy_under_the_blas_in_use(smollm2: LoadedModel,
                                                                                    tmp_path: Path) -> None:
    """The engine path on the real model under whatever BLAS this install picked: a >64-token prefill, batched rounds."""
    drafter = load_drafter(default_drafter_path(), smollm2)
    text = ("def running_mean(values):\n    \"\"\"Return the running mean of a list of numbers, one value per "
            "prefix, as floats. For example running_mean([1, 2, 3]) is [1.0, 1.5, 2.0].\"\"\"\n")
    prompts = [smollm2.tokenizer.encode(text * (2 + i)) for i in range(3)]
    assert min(map(len, prompts)) > 64
    params = GenerationParams(max_tokens=24)
    outputs: dict[int, list[int]] = {}
    log = tmp_path / "rounds.jsonl"

    async def main() -> None:
        async def one(i: int) -> None:
            ids: list[int] = []
            async for event in engine.generate(prompts[i], params):
                ids += event.token_ids
            outputs[i] = ids

        async with Engine(smollm2, drafter, log=log) as engine, anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)

    anyio.run(main)
    rounds = [r for r in map(records.from_json, log.read_text().splitlines()) if isinstance(r, RoundRecord)]
    assert max(r.batch_size for r in rounds) == len(prompts)
    for i, prompt in enumerate(prompts):
        want = run_to_end(generate_plain(smollm2.model, smollm2.tokenizer, prompt, params), len(prompt)).token_ids
        assert outputs[i] == want
