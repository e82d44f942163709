"""Limits and a default priority per model name: a base model or a LoRA adapter.

An operator gives each name that needs one a budget shared by every caller (requests and
tokens per minute, generations at once) and a priority for the requests that ask none::

    SLUICE_GATEWAY_NAME_LIMITS='{"sql-lora": {"rpm": 600, "tpm": 200000, "max_concurrent": 8,
                                              "priority": 5}}'

The budget is enforced as an API key's is, by the same token-bucket scripts
(gateway/admission/tenancy.py) on the name's own buckets, charged with an estimate at
admission and settled with the real usage; a request over it is a 429 naming the model.
A request is charged to its key and to its name, and refused if either is spent.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from sluice.apikeys import ApiKey

#: Bucket prefix of a name's budget (sluice/keys.py: ``rate_limits``); API key prefixes are hex.
PREFIX = "model:"


class NameLimit(BaseModel):
    rpm: int = Field(default=1_000_000, ge=1)
    tpm: int = Field(default=1_000_000_000, ge=1)
    max_concurrent: int = Field(default=1_000_000, ge=1)
    #: Priority of this name's requests that set none (body, header or service_tier).
    priority: int | None = None

    def as_key(self, name: str) -> ApiKey:
        """The name's budget in the shape the tenancy scripts charge."""
        return ApiKey(prefix=PREFIX + name, name=name, tier="model", rpm=self.rpm, tpm=self.tpm,
                      max_concurrent=self.max_concurrent, priority_ceiling=-(2**31), created=0.0)
