"""Engines behind the worker: ``sim`` (anywhere), ``vllm`` (default), ``trtllm`` (NVIDIA)."""
