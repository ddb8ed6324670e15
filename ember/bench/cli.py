"""`ember bench`: measure one or more OpenAI-compatible servers on identical request streams."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ember.bench.client import list_models
from ember.bench.config import WORKLOADS, BenchConfig, Endpoint, LengthDist, Prices
from ember.bench.corpus import Corpus
from ember.bench.launch import LaunchedServer
from ember.bench.report import comparison, endpoint_report, format_table
from ember.bench.runner import EndpointRun, Sent, run_endpoint
from ember.bench.tokenizer import load_tokenizer
from ember.bench.workloads import build_workload

REPORT_VERSION = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("endpoints")
    target.add_argument("--base-url", required=True,
                        help="the server to measure, e.g. http://127.0.0.1:8000 (/v1 optional)")
    target.add_argument("--name", default="base", help="its name in the report (default: base)")
    target.add_argument("--compare", action="append", default=[], metavar="NAME=URL",
                        help="another server, measured after the first on the same requests; "
                             "repeatable; ratios are against --base-url")
    target.add_argument("--model", default=None,
                        help="model name to request (default: each server's first /v1/models)")
    target.add_argument("--api-key", default=None, help="sent as a Bearer token to every server")
    target.add_argument("--launch", action="append", default=[], metavar="NAME=COMMAND",
                        help="start endpoint NAME with this shell command just before measuring "
                             "it and stop it (its process group) just after, so servers never "
                             "share the CPUs; repeatable")
    target.add_argument("--launch-timeout", type=float, default=600.0,
                        help="seconds to wait for a launched server's /v1/models")
    load = parser.add_argument_group("load")
    load.add_argument("--workload", choices=WORKLOADS, default="chat")
    load.add_argument("--concurrency", type=int, default=4,
                      help="requests (agent: sessions) in flight at once")
    load.add_argument("--rate", type=float, default=None,
                      help="Poisson arrivals per second (agent: sessions); default: closed loop")
    load.add_argument("--num-requests", type=int, default=None,
                      help="measured requests per server (default: 10 x concurrency)")
    load.add_argument("--duration", type=float, default=None,
                      help="stop starting requests after this many seconds")
    load.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    load.add_argument("--warmup", type=int, default=0,
                      help="short unmeasured requests per server before the run")
    load.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    shape = parser.add_argument_group("workload shape (lengths in tokens)")
    shape.add_argument("--input-len", default=None, metavar="DIST",
                       help="chat / interference prompt length as the server counts it: N, "
                            "uniform:LO:HI or normal:MEAN:STD (default: 256 chat, 64 "
                            "interference)")
    shape.add_argument("--output-len", default=None, metavar="DIST",
                       help="max_tokens per request, same forms (default: 128 chat, 64 agent "
                            "and interference, 16 long-context)")
    shape.add_argument("--turns", type=int, default=4, help="agent: turns per session")
    shape.add_argument("--system-len", type=int, default=512,
                       help="agent: reference text in the shared system prompt")
    shape.add_argument("--file-len", type=int, default=1024,
                       help="agent: the code file in each session's first message")
    shape.add_argument("--tool-result-len", type=int, default=128,
                       help="agent: the tool result appended each turn")
    shape.add_argument("--context-length", type=int, default=None,
                       help="long-context / interference: the server's context length "
                            "(default: max_model_len from /v1/models)")
    shape.add_argument("--long-requests", type=int, default=4,
                       help="interference: long prefills sent one after another")
    shape.add_argument("--temperature", type=float, default=0.0)
    shape.add_argument("--ignore-eos", action="store_true",
                       help="send ignore_eos so every answer is max_tokens long (ember, vLLM)")
    shape.add_argument("--tokenizer", default=None, metavar="PATH",
                       help="tokenizer folder or .gguf used to cut prompts to exact lengths "
                            "(default: ember's default model, SmolLM2-135M-Instruct); with a "
                            "server whose tokenizer differs, lengths are approximate")
    cost = parser.add_argument_group("cost")
    cost.add_argument("--prices", default=None, metavar="IN,CACHED,OUT",
                      help="USD per million input, cached input and output tokens "
                           "(default: Kimi K2.5's 0.60,0.10,3.00)")
    cost.add_argument("--price-table", default=None, metavar="FILE",
                      help='JSON {"MODEL": {"input": .., "cached_input": .., "output": ..}}; '
                           'a "default" entry applies to other models')
    output = parser.add_argument_group("output")
    output.add_argument("--out", default=None, help="write the JSON report here")
    output.add_argument("--plot", default=None, help="write a PNG of latencies and throughput")
    output.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: when stderr is a terminal)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    endpoints = [Endpoint(args.name, args.base_url, args.model)]
    for spec in args.compare:
        name, sep, url = spec.partition("=")
        if not sep:
            raise ValueError(f"compare: expected NAME=URL, got {spec!r}")
        endpoints.append(Endpoint(name, url, args.model))
    prices = Prices(*_floats(args.prices, "prices")) if args.prices else None
    table = {}
    if args.price_table:
        raw = json.loads(Path(args.price_table).read_text())
        try:
            table = {model: Prices(**entry) for model, entry in raw.items()}
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"price_table: expected {{MODEL: {{input, cached_input, output}}}}"
                             f": {exc}") from None
    launch = {}
    for spec in args.launch:
        name, sep, command = spec.partition("=")
        if not sep or not command:
            raise ValueError(f"launch: expected NAME=COMMAND, got {spec!r}")
        launch[name] = command
    extra = {"prices": prices} if prices else {}
    return BenchConfig(
        endpoints=endpoints, workload=args.workload, concurrency=args.concurrency,
        rate=args.rate, num_requests=args.num_requests, duration=args.duration, seed=args.seed,
        input_len=LengthDist.parse(args.input_len, "input_len") if args.input_len else None,
        output_len=LengthDist.parse(args.output_len, "output_len") if args.output_len else None,
        turns=args.turns, system_len=args.system_len, file_len=args.file_len,
        tool_result_len=args.tool_result_len, context_length=args.context_length,
        long_requests=args.long_requests, temperature=args.temperature,
        ignore_eos=args.ignore_eos, warmup=args.warmup, request_timeout=args.timeout,
        api_key=args.api_key, price_table=table, launch=launch,
        launch_timeout=args.launch_timeout, **extra,
    )


def _floats(spec: str, field_name: str) -> list[float]:
    parts = spec.split(",")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 3:
        raise ValueError(f"{field_name}: expected three numbers IN,CACHED,OUT, got {spec!r}")
    return values


def discover(endpoint: Endpoint, api_key: str | None) -> tuple[str, int | None]:
    """The endpoint's model (given, or the first it lists) and its max_model_len if reported."""
    try:
        cards = asyncio.run(list_models(endpoint, api_key))
    except (httpx.HTTPError, ValueError) as exc:
        if endpoint.model is None:
            raise ConnectionError(f"{endpoint.name}: cannot list models at "
                                  f"{endpoint.api_url}/models: {exc}") from exc
        cards = []
    if endpoint.model is None and not cards:
        raise ConnectionError(f"{endpoint.name}: serves no models; pass --model")
    model = endpoint.model or str(cards[0]["id"])
    lengths = [card["max_model_len"] for card in cards
               if card.get("id") == model and isinstance(card.get("max_model_len"), int)]
    return model, (lengths[0] if lengths else None)


class _Progress:
    """A tqdm bar on stderr counting measured requests and errors."""

    def __init__(self, name: str, total: int | None, enabled: bool) -> None:
        from tqdm import tqdm

        self.errors = 0
        self.bar = tqdm(total=total, desc=name, unit="req", file=sys.stderr, disable=not enabled,
                        dynamic_ncols=True)

    def __call__(self, sent: Sent) -> None:
        if not sent.result.ok:
            self.errors += 1
            self.bar.set_postfix(errors=self.errors, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        tokenizer = load_tokenizer(args.tokenizer)
        corpus = Corpus(tokenizer)
    except (ValueError, OSError) as exc:
        print(f"ember bench: {exc}", file=sys.stderr)
        return 2
    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    state = _State(config.context_length)
    endpoints = []
    for endpoint in config.endpoints:
        try:
            with _launched(config, endpoint):
                run_result = _measure(config, endpoint, corpus, state, show_progress)
        except (ValueError, ConnectionError) as exc:
            print(f"ember bench: {exc}", file=sys.stderr)
            return 2
        endpoints.append(endpoint_report(run_result, tokenizer,
                                         config.prices_for(state.models[endpoint.name])))
    parameters = _parameters(args, config, state, tokenizer.source, corpus)
    report = {"version": REPORT_VERSION, "parameters": parameters, "endpoints": endpoints,
              "comparison": comparison(endpoints)}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        from ember.bench.plot import plot_report

        plot_report(report, args.plot)
    print(format_table(report))
    dead = [e["name"] for e in endpoints if not e["summary"].get("succeeded")]
    if dead:
        print(f"ember bench: no request succeeded on {', '.join(dead)}", file=sys.stderr)
        return 1
    return 0


@dataclass
class _State:
    """What the run learns as it goes: models, the context length, the workload's shape."""

    context_length: int | None
    models: dict[str, str] = field(default_factory=dict)
    workload_parameters: dict[str, Any] = field(default_factory=dict)


def _launched(config: BenchConfig, endpoint: Endpoint) -> AbstractContextManager[Any]:
    command = config.launch.get(endpoint.name)
    if command is None:
        return nullcontext()
    return LaunchedServer(endpoint, command, config.launch_timeout, config.api_key)


def _measure(config: BenchConfig, endpoint: Endpoint, corpus: Corpus, state: _State,
             show_progress: bool) -> EndpointRun:
    """Discover the endpoint's model, build the workload (the same for every endpoint: the
    first reported context length is kept) and run it."""
    model, context_length = discover(endpoint, config.api_key)
    state.models[endpoint.name] = model
    if state.context_length is None:
        state.context_length = context_length
    workload = build_workload(config, corpus, state.context_length)
    state.workload_parameters = workload.parameters
    progress = _Progress(endpoint.name, config.num_requests, show_progress)
    try:
        return run_endpoint(config, endpoint, model, workload, progress)
    finally:
        progress.close()


def _parameters(args: argparse.Namespace, config: BenchConfig, state: _State,
                tokenizer_source: Path, corpus: Corpus) -> dict[str, Any]:
    """The exact parameters of the run, enough to repeat it (the API key is left out)."""
    return {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": [a.replace(config.api_key, "***") if config.api_key else a
                 for a in sys.argv[1:]],
        "workload": config.workload,
        "workload_parameters": state.workload_parameters,
        "concurrency": config.concurrency,
        "rate": config.rate,
        "num_requests": config.num_requests,
        "duration": config.duration,
        "seed": config.seed,
        "warmup": config.warmup,
        "temperature": config.temperature,
        "ignore_eos": config.ignore_eos,
        "request_timeout": config.request_timeout,
        "model": args.model,
        "models": state.models,
        "context_length": state.context_length,
        "endpoints": {e.name: e.base_url for e in config.endpoints},
        "launch": config.launch,
        "tokenizer": str(tokenizer_source),
        "corpus": {"root": str(corpus.root), "files": len(corpus),
                   "python": platform.python_version()},
        "prices_usd_per_million": {e.name: asdict(config.prices_for(state.models[e.name]))
                                   for e in config.endpoints},
    }
