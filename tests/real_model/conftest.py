"""The real default model through vLLM on CPU.

One vLLM worker and its gateway serve every module here: a worker holds about 3 GB and
takes one to four minutes to start on 2 busy cores, so starting one per module cost the
suite several minutes. Modules that need engines of their own (vLLM's server as an
upstream, a second worker to kill) start them, and those stop with their module.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import Proc, StartGateway, StartWorker

#: The shared worker's served name (distinct from the upstream module's, which registers
#: vLLM servers of its own in the same Redis).
MODEL = "smol-shared"


@pytest.fixture(scope="session")
def vllm_worker(start_worker: StartWorker) -> Proc:
    # A tool-call parser for tool_choice "auto"; float32 is the CPU default (engines/vllm_engine.py).
    # Its KV events feed the precise prefix index (test_precise_prefix.py); gateways in the
    # default approximate mode never match those token-block hashes, so the rest is unchanged.
    worker = start_worker(MODEL, engine="vllm", vllm_max_num_seqs=8, tool_call_parser="hermes",
                          env={"VLLM_CPU_OMP_THREADS_BIND": "0", "SLUICE_PREFIX_INDEX": "precise"})
    worker.shared = True
    return worker


@pytest.fixture(scope="session")
def vllm_gateway(vllm_worker: Proc, start_gateway: StartGateway) -> Proc:
    gateway = start_gateway()
    gateway.shared = True
    return gateway


@pytest.fixture
def client(vllm_gateway: Proc) -> Iterator[openai.OpenAI]:
    """The official SDK on the shared gateway (no retries: a failure shows as it is)."""
    with openai.OpenAI(base_url=vllm_gateway.url + "/v1", api_key="x", max_retries=0, timeout=300) as sdk:
        yield sdk
