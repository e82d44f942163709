"""The simulator's KV connector: prefill/decode disaggregation without moving any KV.

A ``prefill`` simulator asked to keep a prompt's KV for a remote decode
(``kv_transfer_params: {"do_remote_decode": true}``, as vLLM's connectors are asked) answers
on its finishing line with parameters naming the prompt it prefilled, shaped as
NixlConnector's (``do_remote_prefill``, ``remote_engine_id``, ``remote_block_ids``) plus a
digest of the prompt. A ``decode`` simulator given them checks the digest against its own
prompt (the prompt plus any resumed tokens), refuses parameters that name another prompt or
none, and instead of prefilling waits ``transfer_ms_per_token`` per prompt token: the KV's
transfer; its usage counts the transferred prompt tokens as cached (vLLM reports the
prefill's own cache hits there), so a test sees that the KV arrived. Its output is the aggregated output (the simulator's tokens depend only on the
prompt, the seed and the position), so a P/D stream can be checked token for token.

A ``both`` simulator ignores the parameters, as vLLM without a connector does.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

from sluice.errors import InvalidRequest
from sluice.prefix import BLOCK_TOKENS
from sluice.roles import BOTH, DECODE, PREFILL, Role


def prompt_digest(prompt: str, resumed: list[int]) -> str:
    text = prompt + "\x00" + ",".join(map(str, resumed))
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@dataclass(frozen=True, slots=True)
class Transfer:
    """What a request's KV parameters ask of this simulator: ``produce`` (a prefill hop:
    return parameters at the end), ``receive_s`` (a decode hop: the KV's transfer time,
    instead of its prefill)."""

    produce: bool = False
    receive_s: float | None = None


NONE = Transfer()


class SimConnector:
    def __init__(self, role: Role = BOTH, transfer_ms_per_token: float = 0.0) -> None:
        self.role = role
        self._transfer_s = transfer_ms_per_token / 1000
        #: This engine's name in the parameters it hands out (NixlConnector's engine id).
        self.engine_id = uuid.uuid4().hex
        self.received = 0

    def transfer(self, params: dict[str, Any] | None, prompt: str, resumed: list[int], prompt_tokens: int) -> Transfer:
        """What ``params`` ask for; raises :class:`InvalidRequest` for parameters this role
        cannot take (a decode hop naming another prompt, or a hop sent to the wrong role)."""
        if params is None or self.role == BOTH:
            return NONE
        if params.get("do_remote_decode"):
            if self.role != PREFILL:
                raise InvalidRequest("this decode worker was sent a prefill hop", param="kv_transfer_params")
            return Transfer(produce=True)
        if params.get("do_remote_prefill"):
            if self.role != DECODE:
                raise InvalidRequest("this prefill worker was sent a decode hop", param="kv_transfer_params")
            if params.get("sim_prompt_digest") != prompt_digest(prompt, resumed):
                raise InvalidRequest("kv_transfer_params name no KV this worker can receive (another prompt's, "
                                     "or none)", param="kv_transfer_params", code="kv_transfer_unknown")
            self.received += 1
            return Transfer(receive_s=self._transfer_s * prompt_tokens)
        return NONE

    def produced(self, prompt: str, resumed: list[int], prompt_tokens: int) -> dict[str, Any]:
        """A prefill hop's parameters for its decode hop."""
        blocks = (prompt_tokens + BLOCK_TOKENS - 1) // BLOCK_TOKENS
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_block_ids": list(range(blocks)), "sim_prompt_digest": prompt_digest(prompt, resumed)}
