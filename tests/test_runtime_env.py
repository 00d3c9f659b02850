"""Settings ``import runtime`` gives MLX before its first GPU work, and that a user's own value wins."""

from __future__ import annotations

import os
import subprocess
import sys


def graph_cache_seen_by_mlx(env: dict[str, str]) -> str:
    code = "import os, runtime; print(os.environ['MLX_CUDA_GRAPH_CACHE_SIZE'])"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_importing_runtime_keeps_more_cuda_graphs_unless_the_user_chose_a_number() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLX_CUDA_GRAPH_CACHE_SIZE"}
    env["DFLASH_BLAS"] = "reference"  # no BLAS probe in the child: this checks the setting only
    assert graph_cache_seen_by_mlx(env) == "1000"
    assert graph_cache_seen_by_mlx({**env, "MLX_CUDA_GRAPH_CACHE_SIZE": "100"}) == "100"
