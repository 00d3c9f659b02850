"""dflash-runtime: DFlash speculative decoding for MLX language models."""

import os

from .blas import preload_openblas

preload_openblas()  # before anything imports mlx: see runtime/blas.py

# MLX's CUDA backend keeps 100 instantiated CUDA graphs (each of at most 20 ops) and instantiates
# one anew on a miss. A round of one request fits, but batched rounds of many requests come in more
# shapes (rows padded to powers of two, newcomers' prefills, KV stacks rebuilt as requests come and
# go): at 32 streams cudaGraphInstantiate took 42% of the host's time (BENCHMARKS.md, session 21).
# MLX reads this at its first GPU commit; a value the user sets wins.
os.environ.setdefault("MLX_CUDA_GRAPH_CACHE_SIZE", "1000")


def __getattr__(name: str):  # lazy: `import runtime` must not import mlx before blas.py ran
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(name)
