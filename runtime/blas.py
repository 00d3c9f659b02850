"""Make MLX's float32 CPU matmuls use OpenBLAS on Linux, on any CPU, or say why not.

The Linux ``mlx-cpu`` wheel links the reference BLAS, whose matmul cost grows with the
number of rows: verifying a 16-token block would cost ~16x one token. Loading OpenBLAS
into the global symbol scope *before* MLX's library is loaded makes MLX bind its
``cblas_*`` calls to it (16 rows then cost about what 1 row does). This must run before
the first ``import mlx``; ``runtime/__init__.py`` calls it first thing.

An OpenBLAS built for one CPU family (``cmeel-openblas`` 0.3.31 is built for SKYLAKEX
and executes AVX-512 in ``sgemm_beta``) dies with an illegal instruction on other CPUs,
and the process with it. So no library is loaded before it has passed a probe: a child
process loads it, runs threaded sgemm/dgemm at a round's shapes and checks the results.
The verdict is cached per library file and CPU (``$XDG_CACHE_HOME/dflash-runtime``), so
the probe runs once. Candidates, first that passes wins:

1. ``DFLASH_BLAS=/path/to/libopenblas.so`` names the only one; ``DFLASH_BLAS=reference``
   keeps the wheel's own BLAS (for measuring the difference).
2. ``ngsolve-openblas`` (a declared dependency): a DYNAMIC_ARCH build, which picks its
   kernels by the CPU it runs on.
3. the system's ``libopenblas.so.0`` (Debian's ``libopenblas0-pthread`` is DYNAMIC_ARCH).
4. ``cmeel-openblas``, where installed (built for one CPU family: the probe decides).

The wheels' libraries need the GNU Fortran runtime ``libgfortran.so.5``. Where the system
has none, they are given the one inside the ``mlx-cpu`` wheel: a folder in the cache links
the library beside it under the name it asks for (the loader looks in ``$ORIGIN``).
When none passes, the reference BLAS runs (same results, slower on blocks) and one line on
stderr says why and what to install.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

SYSTEM_OPENBLAS = "libopenblas.so.0"
PROBE_TIMEOUT_S = 120
LOAD_FAILED = 3  # the probe's exit status when the library does not load: not cached, a missing dependency may come
loaded_blas: str | None = None
rejected: list[str] = []  # "library: why" for every candidate that failed to load or failed the probe


@dataclass(frozen=True)
class Candidate:
    label: str  # what a report calls it
    path: str  # what ctypes loads: a file path, or a bare soname the system's loader resolves
    from_wheel: bool = False  # needs libgfortran.so.5 beside it when the system has none


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash-runtime"


def _wheel_files(dist: str, folder: str, prefixes: tuple[str, ...]) -> list[str]:
    """The shared libraries an installed distribution puts in ``folder`` whose names start with ``prefixes``."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [str(f.locate()) for f in files
            if f.parent.as_posix() == folder and f.name.startswith(prefixes) and ".so" in f.name]


def candidates() -> list[Candidate]:
    asked = os.environ.get("DFLASH_BLAS", "")
    if asked and asked != "openblas":
        return [Candidate(asked, asked, from_wheel=True)]
    found = [Candidate("ngsolve-openblas", path, from_wheel=True)
             for path in _wheel_files("ngsolve-openblas", "ngsolve_openblas", ("libopenblas",))[:1]]
    found.append(Candidate(f"system {SYSTEM_OPENBLAS}", SYSTEM_OPENBLAS))
    found += [Candidate("cmeel-openblas", path, from_wheel=True)
              for path in _wheel_files("cmeel-openblas", "cmeel.prefix/lib", ("libopenblas.so.0",))[:1]]
    return found


def _bundled_fortran_runtime() -> list[Path]:
    """mlx-cpu's own libgfortran and the libquadmath it needs (auditwheel renamed both)."""
    return [Path(p) for p in _wheel_files("mlx-cpu", "mlx_cpu.libs", ("libgfortran-", "libquadmath-"))]


def with_fortran_runtime(library: str) -> str:
    """A path that loads ``library`` with a libgfortran.so.5 its loader will find.

    The system's, if it has one; else a folder of links: the library, mlx-cpu's
    libgfortran under the name ``libgfortran.so.5``, and that one's libquadmath.
    The library's ``$ORIGIN`` is the folder of the link (the loader does not resolve it).
    """
    if ctypes.util.find_library("gfortran") == "libgfortran.so.5":  # the loader's search path has it
        return library
    runtime_files = _bundled_fortran_runtime()
    gfortran = [p for p in runtime_files if p.name.startswith("libgfortran-")]
    if not gfortran:
        return library  # loading it will fail and say libgfortran.so.5 is missing
    real = os.path.realpath(library)
    folder = cache_dir() / "blas-links" / hashlib.sha256(real.encode()).hexdigest()[:16]
    links = {Path(real).name: Path(real), "libgfortran.so.5": gfortran[0]}
    links.update({p.name: p for p in runtime_files if p.name.startswith("libquadmath-")})
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="dflash-blas-"))
    for name, target in links.items():
        link = folder / name
        if link.is_symlink() and os.readlink(link) == str(target):
            continue
        tmp = folder / f".{name}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        os.replace(tmp, link)  # atomic, so concurrent processes never see a half-made link
    return str(folder / Path(real).name)


def _cpu_identity() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    keep = [line for line in text.splitlines() if line.startswith(("vendor_id", "model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))  # the first processor's lines: all cores are alike here


def verdict_key(path: str) -> str:
    real = os.path.realpath(path)
    try:
        stat = os.stat(real)
        file_id = f"{real}:{stat.st_size}:{stat.st_mtime_ns}"
    except OSError:
        file_id = path  # a bare soname: the system's loader resolves it
    return hashlib.sha256(f"{file_id}\n{_cpu_identity()}".encode()).hexdigest()


def _verdicts_file() -> Path:
    return cache_dir() / "blas-verdicts.json"


def _read_verdicts() -> dict[str, dict]:
    try:
        return json.loads(_verdicts_file().read_text())
    except (OSError, ValueError):
        return {}


def _save_verdict(key: str, verdict: dict) -> None:
    verdicts = _read_verdicts()
    verdicts[key] = verdict
    target = _verdicts_file()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        tmp.write_text(json.dumps(verdicts, indent=1))
        os.replace(tmp, target)
    except OSError:
        pass  # an unwritable cache only means probing again next time


def _failure(returncode: int, stderr: str) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return "illegal instruction (SIGILL): built for another CPU" if name == "SIGILL" else f"killed by {name}"
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {returncode}"


class Verdict(NamedTuple):
    ok: bool
    why: str  # why it is unsafe, or why it did not load
    final: bool  # it loaded and ran (or died running): the same library on the same CPU gets the same verdict


def probe(path: str) -> Verdict:
    """Load ``path`` and run its matmuls in a child process: (safe, why not)."""
    env = {**os.environ, "DFLASH_BLAS": "reference", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", "import runtime.blas as b, sys; b.run_probe(sys.argv[1])", path]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Verdict(False, f"its matmuls did not finish in {PROBE_TIMEOUT_S} s", final=True)
    if done.returncode == 0:
        return Verdict(True, "", final=True)
    return Verdict(False, _failure(done.returncode, done.stderr), final=done.returncode != LOAD_FAILED)


def cached_probe(path: str) -> Verdict:
    key = verdict_key(path)
    known = _read_verdicts().get(key)
    if known is not None:
        return Verdict(bool(known["ok"]), str(known["why"]), final=True)
    verdict = probe(path)
    if verdict.final:
        _save_verdict(key, {"library": path, "ok": verdict.ok, "why": verdict.why})
    return verdict


# (rows, inner, cols, transpose b, beta): a token and a block against SmolLM2-sized weights
# (transposed, as MLX multiplies by a linear layer's weight), a prefill large enough that
# OpenBLAS splits it over threads, and beta=1 for the accumulate path (sgemm_beta).
PROBE_SHAPES = ((1, 576, 1536, True, 0.0), (16, 576, 1536, True, 0.0), (64, 1536, 576, False, 1.0),
                (384, 576, 1536, True, 0.0), (384, 1536, 576, False, 1.0))


def _gemm(lib: ctypes.CDLL, dtype: str, a, b, c, trans_b: bool, beta: float) -> None:
    import numpy as np

    func = lib.cblas_sgemm if dtype == "float32" else lib.cblas_dgemm
    scalar = ctypes.c_float if dtype == "float32" else ctypes.c_double
    rows, inner = a.shape
    cols = b.shape[0] if trans_b else b.shape[1]
    pointer = np.ctypeslib.ndpointer(dtype=dtype, flags="C_CONTIGUOUS")
    func.argtypes = [ctypes.c_int] * 6 + [scalar, pointer, ctypes.c_int, pointer, ctypes.c_int, scalar, pointer,
                                          ctypes.c_int]
    func.restype = None
    row_major, no_trans, trans = 101, 111, 112
    func(row_major, no_trans, trans if trans_b else no_trans, rows, cols, inner, 1.0, a, inner, b, b.shape[1],
         beta, c, cols)


def run_probe(path: str) -> None:
    """The child's side of ``probe``: exits non-zero (or dies) unless every product is right."""
    import threading

    import numpy as np

    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        print(f"does not load: {exc}", file=sys.stderr)
        sys.exit(LOAD_FAILED)
    rng = np.random.default_rng(0)
    errors: list[str] = []

    def check(dtype: str) -> None:
        for rows, inner, cols, trans_b, beta in PROBE_SHAPES:
            a = rng.standard_normal((rows, inner)).astype(dtype)
            b = rng.standard_normal((cols, inner) if trans_b else (inner, cols)).astype(dtype)
            c = rng.standard_normal((rows, cols)).astype(dtype)
            want = a.astype(np.float64) @ (b.T if trans_b else b).astype(np.float64) + beta * c
            _gemm(lib, dtype, a, b, c, trans_b, beta)
            if not np.allclose(c, want, rtol=1e-3, atol=1e-2):
                errors.append(f"{dtype} {rows}x{inner}x{cols}: wrong result (max error {np.abs(c - want).max():.3g})")

    threads = [threading.Thread(target=check, args=(dtype,)) for dtype in ("float32", "float32", "float64")]
    for thread in threads:  # concurrent callers, as MLX's CPU stream and a user's thread may be
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        sys.exit(errors[0])


def _gpu_backend_installed() -> bool:
    """MLX's CUDA backend is there: the CPU's matmuls then matter little, so a slow BLAS is not worth a notice."""
    return any(dist.metadata["Name"].lower().startswith("mlx-cuda") for dist in importlib.metadata.distributions())


def _say_reference(fix: str = "pip install ngsolve-openblas, or install the system's DYNAMIC_ARCH OpenBLAS "
                                  "(Debian/Ubuntu: apt-get install libopenblas0-pthread)") -> None:
    if _gpu_backend_installed():
        return
    why = "; ".join(rejected) if rejected else "no OpenBLAS found"
    print(f"dflash-runtime: float32 CPU matmuls use the reference BLAS (same results, far slower on a "
          f"block: ~B times one token) because {why}. Fix: {fix}; DFLASH_BLAS=reference silences this.",
          file=sys.stderr)


def preload_openblas() -> str | None:
    """Load the first OpenBLAS that passes its probe, globally, on Linux; returns what was loaded."""
    global loaded_blas
    if loaded_blas or not sys.platform.startswith("linux"):
        return loaded_blas
    if os.environ.get("DFLASH_BLAS") == "reference":
        return None
    if "mlx.core" in sys.modules:  # too late: MLX already bound its BLAS symbols
        rejected.append("mlx was imported before runtime")
        _say_reference(fix="import runtime (or anything from it) before mlx")
        return None
    for candidate in candidates():
        path = with_fortran_runtime(candidate.path) if candidate.from_wheel else candidate.path
        verdict = cached_probe(path)
        if not verdict.ok:
            rejected.append(f"{candidate.label}: {verdict.why}")
            continue
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        loaded_blas = path
        return path
    _say_reference()
    return None


def blas_in_use() -> str:
    """What float32 CPU matmuls run on, for reports: the OpenBLAS loaded, or the reference BLAS and why."""
    if loaded_blas:
        return loaded_blas
    if not sys.platform.startswith("linux"):
        return "MLX's own"
    return "reference" + (f" ({'; '.join(rejected)})" if rejected else "")
