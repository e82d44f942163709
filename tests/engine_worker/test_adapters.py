"""``--lora name=path`` flags, and the workers that may take them."""

from __future__ import annotations

import pytest

from engine_worker.adapters import parse_loras
from engine_worker.config import WorkerSettings
from engine_worker.worker import Worker
from sluice.models import ModelError


def test_lora_flags_name_adapters_and_their_folders() -> None:
    assert parse_loras(["sql=/a/sql", "chat=/a/chat=v2"]) == {"sql": "/a/sql", "chat": "/a/chat=v2"}


@pytest.mark.parametrize("spec", ["sql", "=/a", "sql=", "bad name=/a"])
def test_a_malformed_lora_flag_is_refused_by_name(spec: str) -> None:
    with pytest.raises(ValueError, match="--lora"):
        parse_loras([spec])


def test_an_embedding_worker_refuses_lora_adapters_at_start() -> None:
    """Regression (merging adapters with pooling): an adapter only generates, so a worker of
    ``--task embed`` given ``--lora`` would register adapters nobody could run on it."""
    with pytest.raises(ModelError, match="--task embed"):
        Worker(WorkerSettings(engine="sim", task="embed", served_model_name="m", lora=["sql=/a/sql"]))
    assert Worker(WorkerSettings(engine="sim", served_model_name="m", lora=["sql=/a/sql"])).adapters.enabled
