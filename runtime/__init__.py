"""dflash-runtime: DFlash speculative decoding for MLX language models."""

from .blas import preload_openblas

preload_openblas()  # before anything imports mlx: see runtime/blas.py
