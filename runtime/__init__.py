"""dflash-runtime: DFlash speculative decoding for MLX language models."""

from .blas import preload_openblas

preload_openblas()  # before anything imports mlx: see runtime/blas.py


def __getattr__(name: str):  # lazy: `import runtime` must not import mlx before blas.py ran
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(name)
