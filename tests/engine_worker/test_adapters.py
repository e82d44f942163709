"""``--lora name=path`` flags."""

from __future__ import annotations

import pytest

from engine_worker.adapters import parse_loras


def test_lora_flags_name_adapters_and_their_folders() -> None:
    assert parse_loras(["sql=/a/sql", "chat=/a/chat=v2"]) == {"sql": "/a/sql", "chat": "/a/chat=v2"}


@pytest.mark.parametrize("spec", ["sql", "=/a", "sql=", "bad name=/a"])
def test_a_malformed_lora_flag_is_refused_by_name(spec: str) -> None:
    with pytest.raises(ValueError, match="--lora"):
        parse_loras([spec])
