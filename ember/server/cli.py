"""`ember serve [MODEL]`: the OpenAI-compatible HTTP server (the default model without MODEL)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from ember.batch import flags as batch_flags
from ember.config import (
    DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from ember.server.config import LOG_LEVELS, ServerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="checkpoint folder or .gguf file (default: the bundled default model)")
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                      help="name(s) clients use for the model; repeatable (default: the "
                           "checkpoint's name)")
    http.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes,
                      help="largest accepted request body")
    http.add_argument("--graceful-shutdown-timeout", type=float,
                      default=ServerConfig.graceful_shutdown_timeout_s, metavar="SECONDS",
                      help="on SIGTERM, how long in-flight requests may take to finish before "
                           "they are aborted")
    http.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    http.add_argument("--access-log", action="store_true", help="log every HTTP request")
    access = parser.add_argument_group("access and limits")
    access.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="require this Bearer key; repeatable")
    access.add_argument("--api-keys-file", default=None, metavar="PATH",
                        help="keys, one a line: KEY [name=ID] [rpm=N] [tpm=N]")
    access.add_argument("--rate-limit-rpm", type=int, default=None,
                        help="requests per minute per key (default: unlimited)")
    access.add_argument("--rate-limit-tpm", type=int, default=None,
                        help="prompt + completion tokens per minute per key (default: unlimited)")
    access.add_argument("--max-queue-depth", type=int, default=ServerConfig.max_queue_depth,
                        help="queued requests past which 'x-ember-reject-if-busy: true' ones "
                             "get 429")
    billing = parser.add_argument_group("billing")
    billing.add_argument("--ledger", default=None, metavar="PATH",
                         help="SQLite billing ledger (default: ~/.cache/ember/ledger.sqlite)")
    billing.add_argument("--price-file", default=None, metavar="PATH",
                         help='JSON {"MODEL" or "default": {"input": USD/1M, "cached_input": '
                              '.., "output": ..}} (default: 0.60 / 0.10 / 3.00)')
    chat = parser.add_argument_group("chat")
    chat.add_argument("--tool-call-parser", default=None, metavar="NAME",
                      help="format of the model's tool calls: kimi_k2, glm45 or hermes (alias "
                           "qwen); default: chosen from the model type and chat template")
    batch_flags.add_arguments(parser)
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    engine.add_argument("--device", default="cpu")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--num-kv-blocks", type=int, default=None)
    engine.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--max-num-seqs", type=int, default=128)
    engine.add_argument("--no-chunked-prefill", action="store_true")
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-parallel-size", type=int, default=1,
                          help="ranks that split each attention and dense layer")
    parallel.add_argument("--expert-parallel-size", type=int, default=1,
                          help="ranks that split the routed experts (divides tp x dp)")
    parallel.add_argument("--data-parallel-size", type=int, default=1,
                          help="groups of tp ranks, each running its own batch")
    parallel.add_argument("--eplb", action="store_true",
                          help="rebalance experts over EP ranks from observed load")
    parallel.add_argument("--eplb-interval-steps", type=int,
                          default=ParallelConfig.eplb_interval_steps, metavar="N",
                          help="steps between expert-load gathers (and rebalances)")
    parallel.add_argument("--eplb-num-redundant-experts", type=int, default=None, metavar="N",
                          help="extra expert slots for hot-expert copies (default: one per EP "
                               "rank)")
    parallel.add_argument("--worker-launcher", choices=("spawn", "external"), default="spawn",
                          help="spawn the rank workers here, or accept workers a launcher "
                               "(torchrun) starts with `python -m ember.executor.worker`")
    parallel.add_argument("--worker-listen", default=None, metavar="HOST:PORT",
                          help="where external workers connect (EMBER_WORKER_AUTHKEY on both "
                               "sides)")


def configs(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    engine = EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                          device=args.device, seed=args.seed),
        cache=CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                          kv_cache_memory_gb=args.kv_cache_memory_gb,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs,
                                  enable_chunked_prefill=not args.no_chunked_prefill),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                expert_parallel_size=args.expert_parallel_size,
                                data_parallel_size=args.data_parallel_size,
                                enable_eplb=args.eplb,
                                eplb_interval_steps=args.eplb_interval_steps,
                                eplb_num_redundant_experts=args.eplb_num_redundant_experts,
                                worker_launcher=args.worker_launcher,
                                worker_listen=args.worker_listen))
    server = ServerConfig(
        host=args.host, port=args.port, served_model_names=list(args.served_model_name),
        api_keys=list(args.api_key), api_keys_file=args.api_keys_file,
        rate_limit_rpm=args.rate_limit_rpm, rate_limit_tpm=args.rate_limit_tpm,
        max_queue_depth=args.max_queue_depth, max_body_bytes=args.max_body_bytes,
        ledger_path=args.ledger, price_file=args.price_file,
        graceful_shutdown_timeout_s=args.graceful_shutdown_timeout, log_level=args.log_level,
        tool_call_parser=args.tool_call_parser, batch=batch_flags.config_from_args(args))
    return server, engine


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; the process then exits (0 after a clean shutdown)."""
    import uvicorn

    from ember.executor.checkpoint import resolve_model_path
    from ember.server.app import build_app

    try:
        server_config, engine_config = configs(args)
        resolve_model_path(engine_config.model.model)
    except (ValueError, FileNotFoundError) as exc:
        print(f"ember serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=server_config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(server_config, engine_config)
    server = uvicorn.Server(uvicorn.Config(
        app, host=server_config.host, port=server_config.port,
        log_level=server_config.log_level, access_log=args.access_log, lifespan="on",
        timeout_graceful_shutdown=server_config.graceful_shutdown_timeout_s))
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully; with
    # these handlers that ends in a clean exit instead of a KeyboardInterrupt or SIGTERM death
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    asyncio.run(server.serve())
    code = 0 if server.started else 1
    # the engine core is stopped and the ledger closed; skip the seconds-long interpreter
    # teardown of torch and transformers so a supervisor's restart is not held up
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
