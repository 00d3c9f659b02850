"""Shared fixtures: tiny checkpoints written once per session, and the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest

import runtime  # noqa: F401  (loads OpenBLAS before mlx)
from runtime.defaults import default_model_path
from runtime.loading import LoadedModel, load_drafter, load_target
from runtime.models.dflash import DFlashDrafter

from . import fixtures


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = fixtures.tiny_config("llama")
    return fixtures.hf_folder(tmp_path_factory.mktemp("llama"), config, fixtures.random_weights(config))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = fixtures.tiny_config("qwen3")
    return fixtures.hf_folder(tmp_path_factory.mktemp("qwen3"), config, fixtures.random_weights(config, seed=1))


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir: Path) -> LoadedModel:
    return load_target(tiny_llama_dir, dtype="float32")


@pytest.fixture(scope="session")
def tiny_drafter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = fixtures.drafter_config(fixtures.tiny_config("llama"), block_size=16)
    return fixtures.drafter_folder(tmp_path_factory.mktemp("drafter"), config, fixtures.drafter_weights(config))


@pytest.fixture(scope="session")
def tiny_drafter(tiny_drafter_dir: Path, tiny_llama: LoadedModel) -> DFlashDrafter:
    return load_drafter(tiny_drafter_dir, tiny_llama)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    try:
        path = default_model_path()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"default model not installed: {exc}")
    return load_target(path, dtype="float32")
