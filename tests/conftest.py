"""Shared fixtures: the real conf/ composed with Hydra's compose API, shrunk to tiny sizes."""

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import DictConfig

from runner.config import compose_config

REPO = Path(__file__).resolve().parent.parent

# Tiny sizes per model family: a few seconds a run on a 2-core CPU.
TINY = {
    "transformer": [
        "model=transformer",
        "model.h=16",
        "model.layers=1",
        "model.heads=2",
        "data.seq_len=8",
        "data.vocab_size=16",
    ],
    "mobilenet": ["model=mobilenet", "model.alpha=0.35", "data.image_size=32"],
    "efficientnet": ["model=efficientnet", "data.image_size=32"],
}
TINY_DATA = ["data.batch_size=4", "data.train_samples=32", "data.val_samples=8"]
TINY_TRAINER = ["trainer.max_steps=3", "trainer.progress=false"]


def tiny_overrides(model: str = "transformer", store: str | None = None) -> list[str]:
    extra = [f"mlflow.tracking_uri={store}"] if store else []
    return TINY[model] + TINY_DATA + TINY_TRAINER + extra


@pytest.fixture
def store(tmp_path) -> str:
    """A fresh SQLite MLflow store in a temp dir."""
    return f"sqlite:///{tmp_path}/mlflow.db"


@pytest.fixture
def tiny_cfg(store):
    def make(model: str = "transformer", *extra: str) -> DictConfig:
        return compose_config(tiny_overrides(model, store) + list(extra))

    return make


def run_cli(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 600):
    """`python run.py ARGS` as a user types it, from another directory."""
    import os

    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
