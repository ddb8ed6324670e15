"""The batch lane: does a saturating batch job hurt interactive latency, and how much of the
engine's idle throughput does the batch lane get? One `ember serve`, one run.

Each of --rounds rounds runs, one after another (so the machine's noise spreads over all):
  alone     `ember bench` chat at --concurrency, nothing else running;
  together  the same load (another seed: nothing cached from before) while a batch job keeps
            the batch lane full (--batch-concurrency items in the engine); the job is
            cancelled after the bench;
  control   (with --control) the same, the background load sent as plain interactive
            requests instead (no batch lane);
  idle      --batch-items requests of the batch items' shape sent directly (non-streaming
            chat, --batch-concurrency at a time): the engine's idle output throughput;
  batch     as many items through /v1/files + /v1/batches, from upload to `completed`.
TTFT and ITL percentiles are over the requests of the rounds pooled, leaving out rounds in
which other processes on the machine took a share of the CPU (see --max-foreign).

Prompts are stdlib excerpts as `ember bench` cuts them; every answer is max_tokens long
(ignore_eos). The machine is shared and noisy: read the ratios.

    python benchmarks/batch_lane.py [--model PATH] [--rounds 2] [--control] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

from ember.bench.corpus import Corpus
from ember.bench.report import percentile
from ember.bench.tokenizer import load_tokenizer
from ember.bench.workloads import CHAT_INSTRUCTION

MODEL = "bench-model"
Messages = list[dict[str, str]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "ember.cli", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--served-model-name", MODEL, "--ledger",
           str(folder / "ledger.sqlite"), "--batch-store", f"sqlite:///{folder / 'b.sqlite'}",
           "--batch-max-inflight", str(args.batch_concurrency), "--batch-poll-interval", "0.2",
           "--log-level", "warning", *args.server_arg]
    with open(folder / "server.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"ember serve exited; see {folder / 'server.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("ember serve did not start")
        time.sleep(0.5)


class Bench:
    def __init__(self, args: argparse.Namespace, url: str, folder: Path) -> None:
        self.args = args
        self.url = url
        self.folder = folder
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                    timeout=600)
        tokenizer = load_tokenizer(None)
        self.corpus = Corpus(tokenizer)
        self.overhead = tokenizer.count_chat([{"role": "user", "content": CHAT_INSTRUCTION}])

    def interactive(self, name: str, seed: int, requests: int | None = None,
                    output_len: int | None = None) -> dict[str, Any]:
        """One `ember bench` chat run; returns its report's endpoint entry."""
        a = self.args
        out = self.folder / f"{name}.json"
        subprocess.run([sys.executable, "-m", "ember.cli", "bench", "--base-url", self.url,
                        "--name", name, "--workload", "chat", "--concurrency",
                        str(a.concurrency), "--num-requests", str(requests or a.requests),
                        "--input-len", str(a.input_len), "--output-len",
                        str(output_len or a.output_len), "--ignore-eos", "--temperature", "0",
                        "--seed", str(seed), "--warmup", "0", "--out", str(out),
                        "--no-progress"], check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["endpoints"][0]

    def prompts(self, n: int, seed: int) -> list[Messages]:
        """n chat prompts of about --input-len tokens, template included."""
        rng = random.Random(seed)
        size = max(1, self.args.input_len - self.overhead)
        return [[{"role": "user", "content": CHAT_INSTRUCTION + self.corpus.excerpt(
            size, rng.randrange(len(self.corpus)), rng.random())}] for _ in range(n)]

    def chat(self, messages: Messages) -> int:
        done = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=self.args.batch_output_len,
            temperature=0, extra_body={"ignore_eos": True})
        return done.usage.completion_tokens

    def idle(self, seed: int) -> dict[str, float]:
        """The batch items' requests sent directly, --batch-concurrency at a time."""
        prompts = self.prompts(self.args.batch_items, seed)
        start = time.monotonic()
        with ThreadPoolExecutor(self.args.batch_concurrency) as pool:
            tokens = sum(pool.map(self.chat, prompts))
        elapsed = time.monotonic() - start
        return {"seconds": elapsed, "output_tokens": tokens,
                "output_tokens_per_s": tokens / elapsed}

    def submit(self, prompts: list[Messages]) -> str:
        lines = [json.dumps({"custom_id": f"item-{i}", "method": "POST",
                             "url": "/v1/chat/completions",
                             "body": {"model": MODEL, "messages": m,
                                      "max_tokens": self.args.batch_output_len,
                                      "ignore_eos": True, "temperature": 0}})
                 for i, m in enumerate(prompts)]
        file_id = self.client.files.create(file=("items.jsonl", "\n".join(lines).encode()),
                                           purpose="batch").id
        return self.client.batches.create(input_file_id=file_id,
                                          endpoint="/v1/chat/completions",
                                          completion_window="24h").id

    def wait(self, batch_id: str, statuses: tuple[str, ...]) -> Any:
        while (batch := self.client.batches.retrieve(batch_id)).status not in statuses:
            time.sleep(0.1)
        return batch

    def batch(self, seed: int) -> dict[str, float]:
        """A job of --batch-items from upload to completed."""
        prompts = self.prompts(self.args.batch_items, seed)
        start = time.monotonic()
        batch = self.wait(self.submit(prompts), ("completed", "failed", "expired", "cancelled"))
        elapsed = time.monotonic() - start
        return {"seconds": elapsed, "items": batch.request_counts.completed,
                "output_tokens": batch.usage.output_tokens,
                "output_tokens_per_s": batch.usage.output_tokens / elapsed}

    def open_requests(self) -> int:
        return httpx.get(f"{self.url}/health").json()["open_requests"]

    def wait_open(self, at_least: int | None = None) -> None:
        """Until the engine holds >= at_least requests, or (None) none at all."""
        deadline = time.monotonic() + 300
        while (self.open_requests() < at_least if at_least else self.open_requests() > 0):
            if time.monotonic() > deadline:
                raise RuntimeError("the engine did not reach the expected load")
            time.sleep(0.1)

    def together(self, name: str, seed: int) -> tuple[dict[str, Any], float]:
        """Interactive load while a batch job fills the batch lane; the job's output tok/s."""
        job = self.submit(self.prompts(self.args.batch_items * 40, seed + 1000))
        self.wait_open(self.args.batch_concurrency)
        before, start = self.client.batches.retrieve(job).usage.output_tokens, time.monotonic()
        run = self.interactive(name, seed)
        during = (self.client.batches.retrieve(job).usage.output_tokens - before) / (
            time.monotonic() - start)
        try:
            self.client.batches.cancel(job)
        except openai.ConflictError:
            print(f"warning: {name}: the batch job ended before the interactive run did",
                  file=sys.stderr)
        self.wait(job, ("cancelled", "completed"))
        self.wait_open(None)
        return run, during

    def control(self, seed: int) -> dict[str, Any]:
        """The background load as plain interactive requests, no batch lane."""
        stop, queue, lock = threading.Event(), self.prompts(self.args.batch_items * 10, seed), \
            threading.Lock()

        def loop() -> None:
            while not stop.is_set():
                with lock:
                    if not queue:
                        return
                    messages = queue.pop()
                self.chat(messages)

        threads = [threading.Thread(target=loop) for _ in range(self.args.batch_concurrency)]
        for t in threads:
            t.start()
        self.wait_open(self.args.batch_concurrency)
        run = self.interactive(f"control{seed}", seed + 1)
        stop.set()
        for t in threads:
            t.join()
        return run


class CpuMeter:
    """CPU time other processes used while a phase ran, as a share of the machine (the
    development machines are shared: a round where others ran is noise, not a result)."""

    def __init__(self, own_pids: list[int]) -> None:
        self.own_pids = own_pids

    @staticmethod
    def _busy() -> float:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # - idle, iowait

    def _own(self) -> float:
        pids = set(self.own_pids)
        stats = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
        grew = True
        while grew:  # the processes below ours: the engine core, `ember bench`
            more = {pid for pid, f in stats.items() if int(f[1]) in pids} - pids
            grew = bool(more)
            pids |= more
        ticks = sum(float(stats[p][11]) + float(stats[p][12]) + float(stats[p][13])
                    + float(stats[p][14]) for p in pids if p in stats)
        return ticks / os.sysconf("SC_CLK_TCK")

    def measure(self, fn: Any, *args: Any) -> tuple[Any, float]:
        busy, own, start = self._busy(), self._own(), time.monotonic()
        result = fn(*args)
        foreign = (self._busy() - busy) - (self._own() - own)
        return result, max(0.0, foreign) / ((time.monotonic() - start) * os.cpu_count())


def pooled(runs: list[dict[str, Any]], metric: str) -> dict[str, float]:
    """Percentiles of TTFT ("ttft_s") or ITL ("itl_s") over all requests of the runs."""
    values = []
    for run in runs:
        for r in run["requests"]:
            value = r[metric]
            values += value if isinstance(value, list) else [] if value is None else [value]
    return {"count": len(values), **{f"p{q}": percentile(values, q) for q in (50, 90, 99)},
            "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2, help="interactive requests at once")
    parser.add_argument("--requests", type=int, default=16, help="interactive requests per run")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32, help="interactive max_tokens")
    parser.add_argument("--batch-items", type=int, default=48)
    parser.add_argument("--batch-output-len", type=int, default=64)
    parser.add_argument("--batch-concurrency", type=int, default=16,
                        help="the server's --batch-max-inflight, and the idle run's concurrency")
    parser.add_argument("--control", action="store_true",
                        help="also measure the background load sent as interactive requests")
    parser.add_argument("--max-foreign", type=float, default=0.1,
                        help="a comparison leaves out the rounds where other processes used "
                             "more than this share of the CPU in one of its phases")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="passed on to `ember serve`; repeatable (--server-arg=--dtype ...)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="ember-batch-bench-"))
    proc, url = start_server(args, folder)
    meter = CpuMeter([os.getpid(), proc.pid])
    results: dict[str, Any] = {"parameters": vars(args), "cpus": os.cpu_count(), "rounds": []}
    try:
        b = Bench(args, url, folder)
        b.interactive("warmup", 90, requests=8, output_len=8)  # first shapes, allocations
        b.idle(91)
        for r in range(args.rounds):
            row: dict[str, Any] = {"foreign_cpu": {}}
            phases = [("alone", b.interactive, f"alone{r}", 10 + r),
                      ("together", b.together, f"together{r}", 20 + r),
                      ("control", b.control, 50 + 10 * r), ("idle", b.idle, 30 + r),
                      ("batch", b.batch, 40 + r)]
            for name, fn, *fn_args in phases:
                if name == "control" and not args.control:
                    continue
                row[name], row["foreign_cpu"][name] = meter.measure(fn, *fn_args)
            row["together"], row["during"] = row["together"]
            results["rounds"].append(row)
            print(f"round {r}: others used " + ", ".join(
                f"{k} {v:.0%}" for k, v in row["foreign_cpu"].items()) + " of the CPU",
                file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    report(results, args.max_foreign)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


def report(r: dict[str, Any], max_foreign: float) -> None:
    """Each comparison pools the rounds where none of its phases shared the machine."""

    def clean(*phases: str) -> list[dict[str, Any]]:
        return [x for x in r["rounds"]
                if all(p in x and x["foreign_cpu"][p] <= max_foreign for p in phases)]

    print(f"rounds: {len(r['rounds'])}; a comparison uses those where other processes took at "
          f"most {max_foreign:.0%} of the CPU in each of its phases")
    print(f"{'seconds, pooled':34} {'rounds':>6} {'TTFT p50':>8} {'p90':>6} {'p99':>6} "
          f"{'max':>6} {'ITL p50':>8} {'p99':>6}")
    for other, label in (("together", "interactive + batch job"),
                         ("control", "interactive + same load, no lane")):
        rounds = clean("alone", other)
        if not rounds:
            print(f"{label}: no clean round")
            continue
        for key, name in (("alone", "interactive alone"), (other, label)):
            t, i = pooled([x[key] for x in rounds], "ttft_s"), pooled([x[key] for x in rounds],
                                                                     "itl_s")
            print(f"{name:34} {len(rounds):6d} {t['p50']:8.3f} {t['p90']:6.3f} {t['p99']:6.3f} "
                  f"{t['max']:6.3f} {i['p50']:8.4f} {i['p99']:6.3f}")
        base = pooled([x["alone"] for x in rounds], "ttft_s")
        mine = pooled([x[other] for x in rounds], "ttft_s")
        print(f"  TTFT ratio to alone: p50 {mine['p50'] / base['p50']:.2f}, "
              f"p99 {mine['p99'] / base['p99']:.2f}")
    rounds = clean("idle", "batch")
    if not rounds:
        print("throughput: no clean round")
        return
    ratios = sorted(x["batch"]["output_tokens_per_s"] / x["idle"]["output_tokens_per_s"]
                    for x in rounds)
    print("output tok/s, idle / batch job by round: " + ", ".join(
        f"{x['idle']['output_tokens_per_s']:.1f} / {x['batch']['output_tokens_per_s']:.1f}"
        for x in rounds) + "; batch / idle median " + f"{ratios[len(ratios) // 2]:.2f}")
    during = clean("together")
    print("batch job output tok/s while the interactive load ran: "
          + ", ".join(f"{x['during']:.1f}" for x in during))


if __name__ == "__main__":
    sys.exit(main())
