"""Make MLX's float32 CPU matmuls use OpenBLAS on Linux.

The Linux ``mlx-cpu`` wheel links the reference BLAS, whose matmul cost grows with the
number of rows: verifying a 16-token block would cost ~16x one token. Loading OpenBLAS
into the global symbol scope *before* MLX's library is loaded makes MLX bind its
``cblas_*`` calls to it (16 rows then cost about what 1 row does). This must run before
the first ``import mlx``; ``runtime/__init__.py`` calls it first thing.

Set ``DFLASH_BLAS=reference`` to keep the wheel's own BLAS (for measuring the difference).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import sys

SYSTEM_CANDIDATES = ("libopenblas.so.0", "libopenblas.so")
loaded_blas: str | None = None
load_errors: list[str] = []  # why each candidate failed: the wheel's library needs libgfortran.so.5 (Debian libgfortran5)


def _candidates() -> list[str]:
    paths: list[str] = []
    try:  # the cmeel-openblas wheel, a declared Linux dependency
        dist = importlib.metadata.distribution("cmeel-openblas")
        paths.append(str(dist.locate_file("cmeel.prefix/lib/libopenblas.so.0")))
    except importlib.metadata.PackageNotFoundError:
        pass
    return paths + list(SYSTEM_CANDIDATES)


def preload_openblas() -> str | None:
    """Load OpenBLAS globally if on Linux and not disabled; returns the library loaded."""
    global loaded_blas
    if loaded_blas or not sys.platform.startswith("linux"):
        return loaded_blas
    if os.environ.get("DFLASH_BLAS", "openblas") == "reference":
        return None
    if "mlx.core" in sys.modules:
        return None  # too late: MLX already bound its BLAS symbols
    for path in _candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            load_errors.append(str(exc))
            continue
        loaded_blas = path
        return path
    return None


def blas_in_use() -> str:
    """What float32 CPU matmuls run on, for reports: the OpenBLAS loaded, or the reference BLAS and why."""
    if loaded_blas:
        return loaded_blas
    if not sys.platform.startswith("linux"):
        return "MLX's own"
    return "reference" + (f" (OpenBLAS did not load: {load_errors[0]})" if load_errors else "")
