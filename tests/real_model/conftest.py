"""The real default model through vLLM on CPU.

One vLLM worker and its gateway serve every module here: a worker holds about 3 GB and
takes one to four minutes to start on 2 busy cores, so starting one per module cost the
suite several minutes. Modules that need engines of their own (vLLM's server as an
upstream, a second worker to kill) start them, and those stop with their module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from sluice.models import default_model_dir
from tests.conftest import Proc, StartGateway, StartWorker

#: A vLLM engine starts in 35-120 s on this 2-core machine, slower while other engines run:
#: whichever test first needs an engine (a session or module fixture) waits for that start
#: inside its own timeout. The suite's 120 s is too short for it (CI, 2026-12-02: two engines
#: started side by side for test_disaggregation_vllm took 118 s and the setup timed out).
REAL_MODEL_TIMEOUT_S = 600


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(REAL_MODEL_TIMEOUT_S))

#: The shared worker's served name (distinct from the upstream module's, which registers
#: vLLM servers of its own in the same Redis).
MODEL = "smol-shared"


#: The LoRA adapter the shared worker serves (tests/real_model/test_lora.py), made at start.
ADAPTER = "smol-tiny-lora"


def make_adapter(out: Path) -> Path:
    """A rank-8 adapter of the default model on the attention projections, with random (not
    zero) weights, so it visibly changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def vllm_worker(start_worker: StartWorker, tmp_path_factory: pytest.TempPathFactory) -> Proc:
    # A tool-call parser for tool_choice "auto"; float32 is the CPU default (engines/vllm_engine.py).
    # Its KV events feed the precise prefix index (test_precise_prefix.py); gateways in the
    # default approximate mode never match those token-block hashes, so the rest is unchanged.
    # One LoRA adapter (peft, the dev extra): base-model requests run as before beside it.
    adapter = make_adapter(tmp_path_factory.mktemp("lora") / "tiny")
    worker = start_worker(MODEL, "--lora", f"{ADAPTER}={adapter}", engine="vllm", vllm_max_num_seqs=8,
                          tool_call_parser="hermes",
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
