"""A LoRA adapter on the real default model (vLLM on CPU), made at test time with ``peft``,
served by a worker started with ``--lora`` and reached through the gateway with the SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from sluice.models import default_model_dir, is_prepared
from tests.conftest import Proc

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not is_prepared(default_model_dir()), reason="run 'sluice model prepare' first"),
    pytest.mark.timeout(900),
]

MODEL = "smol-lora"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def make_adapter(out: Path) -> Path:
    """A rank-8 adapter on the attention projections with random (not zero) weights, so it
    visibly changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def lora_gateway(start_worker, start_gateway, tmp_path_factory: pytest.TempPathFactory) -> Proc:
    adapter = make_adapter(tmp_path_factory.mktemp("lora") / "tiny")
    start_worker(MODEL, "--lora", f"tiny={adapter}", engine="vllm", vllm_max_num_seqs=4,
                 env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    return start_gateway()


@pytest.fixture
def client(lora_gateway: Proc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=lora_gateway.url + "/v1", api_key="x", max_retries=0, timeout=300) as sdk:
        yield sdk


def test_the_adapter_is_listed_and_answers_differently_from_its_base_model(client) -> None:
    listed = {m.id: m for m in client.models.list().data}
    assert listed["tiny"].model_extra["parent"] == MODEL
    base = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16)
    assert "Paris" in (base.choices[0].message.content or "")
    tuned = [client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=16)
             for _ in range(2)]
    assert tuned[0].model == "tiny"
    assert tuned[0].choices[0].message.content == tuned[1].choices[0].message.content  # greedy: one answer
    assert tuned[0].choices[0].message.content != base.choices[0].message.content
