"""runtime.blas: which BLAS the CPU's float32 matmuls use, and a report that says so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def blas_reported(**env: str) -> str:
    code = "import runtime.blas as b; print(b.blas_in_use())"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS is preloaded on Linux only")
def test_reference_blas_when_asked_for_and_openblas_otherwise_where_it_loads() -> None:
    assert blas_reported(DFLASH_BLAS="reference") == "reference"
    default = blas_reported()
    # either the OpenBLAS library loaded, or the reference BLAS with the loader's reason (a missing libgfortran.so.5)
    assert "libopenblas" in default.split("/")[-1] or default.startswith("reference (OpenBLAS did not load: ")
