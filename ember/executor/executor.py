"""The engine core's side of parallel execution: one worker process per rank.

The workers are spawned here (one host), or started by a launcher such as torchrun on every
host and connect to a listener here (`worker_launcher="external"`; see worker.py).
`MultiprocExecutor.execute(out)` sends each rank its data-parallel group's share of the step
and waits for every rank's answer, watching the workers' connections (and, when spawned, their
processes) at once: a rank that dies, raises or stalls past `worker_timeout_s` ends the wait
with `WorkerFailedError` naming it, and the remaining workers are stopped; nothing waits
forever.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, wait
from multiprocessing.process import BaseProcess

from ember import envs
from ember.config import EngineConfig
from ember.core.scheduler import ScheduledRequest, SchedulerOutput
from ember.distributed.layout import RankLayout
from ember.executor.expert_balancer import ExpertBalancer, ExpertLoadReport
from ember.executor.model_runner import StepResult
from ember.executor.worker import (
    ApplyPlacement,
    ExecuteStep,
    ExpertLoad,
    GatherExpertLoad,
    ShutdownWorker,
    StepDone,
    WorkerAssignment,
    WorkerFailed,
    WorkerHello,
    WorkerInput,
    WorkerMessage,
    WorkerReady,
    run_worker,
)

logger = logging.getLogger(__name__)

FAILURE_GRACE_S = 1.0  # after one rank fails, how long to wait for a peer's root-cause death
STOP_TIMEOUT_S = 5.0


@dataclass
class DataParallelOutput:
    """One SchedulerOutput per data-parallel group, in group order."""

    parts: list[SchedulerOutput]

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        return [sr for part in self.parts for sr in part.scheduled]

    @property
    def finished_request_ids(self) -> set[str]:
        return set().union(*(part.finished_request_ids for part in self.parts))

    @property
    def num_batched_tokens(self) -> int:
        return sum(part.num_batched_tokens for part in self.parts)

    @property
    def is_empty(self) -> bool:
        return all(part.is_empty for part in self.parts)


class WorkerFailedError(RuntimeError):
    """A worker process died, raised, or stopped answering; the step cannot complete."""


@dataclass
class _Worker:
    rank: int
    process: BaseProcess | None  # None for workers a launcher started
    conn: Connection
    pid: int | None = None


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MultiprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        p = config.parallel
        self.config = config
        self.layout = RankLayout(0, p.tensor_parallel_size, p.data_parallel_size,
                                 p.expert_parallel_size)
        self.timeout_s = p.worker_timeout_s
        self.dead: str | None = None
        self.workers: list[_Worker] = (self._spawn_workers() if p.worker_launcher == "spawn"
                                       else self._accept_workers())
        self._finalizer = weakref.finalize(self, _stop_workers, list(self.workers), 0.0)
        ready = self._collect(timeout=None, what="loading the model")
        for worker in self.workers:
            worker.pid = ready[worker.rank].pid
            logger.info("worker rank %d: pid %d, %.1f MB of parameters", worker.rank,
                        worker.pid, ready[worker.rank].param_bytes / 1e6)
        self.ready: dict[int, WorkerReady] = ready
        self.num_kv_blocks = min(r.num_kv_blocks for r in ready.values())
        self.kv_bytes_per_token = ready[0].kv_bytes_per_token
        self.step_stats: dict[int, StepDone] = {}
        self.num_steps = 0
        self.balancer = (ExpertBalancer(p, ready[0].placements)
                         if p.expert_parallel_size > 1 and ready[0].placements else None)

    def _spawn_workers(self) -> list[_Worker]:
        p = self.config.parallel
        port = p.master_port or free_port(p.master_addr)
        init_method = f"tcp://{p.master_addr}:{port}"
        ctx = multiprocessing.get_context("spawn")
        workers = []
        for rank in range(self.layout.world_size):
            conn, child_conn = ctx.Pipe()
            process = ctx.Process(target=run_worker,
                                  args=(rank, self.config, init_method, child_conn),
                                  name=f"ember-worker-{rank}", daemon=True)
            process.start()
            child_conn.close()
            workers.append(_Worker(rank, process, conn))
        return workers

    def _accept_workers(self) -> list[_Worker]:
        """Wait (up to worker_timeout_s) for every rank to connect; hand each the config."""
        authkey = envs.worker_authkey()
        if authkey is None:
            raise ValueError("worker_launcher: external workers need EMBER_WORKER_AUTHKEY set "
                             "(the same on the engine and every worker)")
        host, _, port = self.config.parallel.worker_listen.rpartition(":")
        world = self.layout.world_size
        workers: dict[int, _Worker] = {}
        with Listener((host, int(port)), authkey=authkey) as listener:
            def accept() -> None:
                while len(workers) < world:
                    try:
                        conn = listener.accept()
                    except AuthenticationError:
                        logger.error("refused a worker with the wrong EMBER_WORKER_AUTHKEY")
                        continue
                    except OSError:
                        return  # the listener closed: time is up
                    try:
                        hello = conn.recv() if conn.poll(self.timeout_s) else None
                    except Exception:  # whatever a stranger sent: refuse it
                        hello = None
                    if (not isinstance(hello, WorkerHello) or hello.world_size != world
                            or not 0 <= hello.rank < world or hello.rank in workers):
                        logger.error("refused worker %s (engine world size %d)", hello, world)
                        conn.close()
                        continue
                    logger.info("worker rank %d connected from %s (pid %d)", hello.rank,
                                hello.host, hello.pid)
                    workers[hello.rank] = _Worker(hello.rank, None, conn, hello.pid)

            thread = threading.Thread(target=accept, name="ember-worker-accept", daemon=True)
            thread.start()
            thread.join(self.timeout_s)
        if len(workers) < world:
            for worker in workers.values():
                worker.conn.close()
            missing = sorted(set(range(world)) - set(workers))
            raise WorkerFailedError(f"worker rank(s) {missing} did not connect to "
                                    f"{host}:{port} in {self.timeout_s:.0f}s")
        for worker in workers.values():
            worker.conn.send(WorkerAssignment(self.config))
        return [workers[r] for r in range(world)]

    @property
    def expert_load_reports(self) -> list[ExpertLoadReport]:
        return self.balancer.reports if self.balancer is not None else []

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def execute(self, out: SchedulerOutput | DataParallelOutput) -> StepResult:
        parts = out.parts if isinstance(out, DataParallelOutput) else [out]
        if all(part.is_empty and not part.finished_request_ids for part in parts):
            return StepResult({}, {})
        any_work = not all(part.is_empty for part in parts)
        for worker in self.workers:
            part = parts[worker.rank // self.layout.tensor_parallel_size]
            if worker.rank % self.layout.tensor_parallel_size:
                part = _without_history(part)
            self._send(worker, ExecuteStep(part, any_work))
        replies = self._collect(timeout=self.timeout_s, what="a step")
        sampled: dict[str, int] = {}
        logprobs: dict[str, tuple[float, dict[int, float]]] = {}
        for rank, reply in replies.items():
            self.step_stats[rank] = reply
            if reply.result is not None:
                sampled.update(reply.result.sampled)
                logprobs.update(reply.result.logprobs)
        if any_work:
            self.num_steps += 1
            if self.balancer is not None and self.balancer.due(self.num_steps):
                self._balance_experts()
        return StepResult(sampled, logprobs)

    def _balance_experts(self) -> None:
        """Between steps: gather expert load; with --eplb, move experts to a better placement."""
        for worker in self.workers:
            self._send(worker, GatherExpertLoad())
        load: ExpertLoad = self._collect(timeout=self.timeout_s, what="gathering expert load")[0]
        report = self.balancer.record(self.num_steps, load.slot_load)
        placements = self.balancer.rebalance(report)
        if placements is None:
            return
        logger.info("eplb: busiest EP rank ran %.0f%% of routed tokens; moving experts in %d "
                    "layers", 100 * report.busiest_rank_share, len(placements))
        for worker in self.workers:
            self._send(worker, ApplyPlacement(placements))
        self._collect(timeout=self.timeout_s, what="moving experts")

    def shutdown(self) -> None:
        """Ask the workers to exit; stop the ones that do not within a few seconds."""
        if self.dead is None and self._finalizer.alive:
            for worker in self.workers:
                try:
                    worker.conn.send(ShutdownWorker())
                except OSError:
                    pass
            _stop_workers(self.workers, STOP_TIMEOUT_S)
        self._finalizer()

    # ---- internals ----------------------------------------------------------------------

    def _send(self, worker: _Worker, msg: WorkerInput) -> None:
        if self.dead is not None:
            raise WorkerFailedError(self.dead)
        try:
            worker.conn.send(msg)
        except OSError:
            self._fail(f"worker rank {worker.rank} closed its pipe")

    def _collect(self, timeout: float | None, what: str) -> dict[int, WorkerMessage]:
        """One message from every rank; raises WorkerFailedError on the first failure."""
        if self.dead is not None:
            raise WorkerFailedError(self.dead)
        pending = {w.conn: w for w in self.workers}
        sentinels = {w.process.sentinel: w for w in self.workers if w.process is not None}
        replies: dict[int, WorkerMessage] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                ranks = sorted(w.rank for w in pending.values())
                self._fail(f"worker rank(s) {ranks} did not finish {what} in {timeout:.0f}s")
            ready = wait([*pending, *sentinels], timeout=left)
            for conn in [r for r in ready if r in pending]:  # messages first: they say why
                worker = pending.pop(conn)
                try:
                    msg = worker.conn.recv()
                except (EOFError, OSError):
                    self._fail(self._death_reason(worker))
                if isinstance(msg, WorkerFailed):
                    logger.error("worker rank %d failed:\n%s", msg.rank, msg.message)
                    self._fail(self._root_cause(msg))
                replies[worker.rank] = msg
            for sentinel in [r for r in ready if r in sentinels]:
                worker = sentinels[sentinel]
                if not (worker.conn in pending and worker.conn.poll()):
                    self._fail(self._death_reason(worker))
        return replies

    def _death_reason(self, worker: _Worker) -> str:
        if worker.process is None:
            return f"worker rank {worker.rank} (pid {worker.pid}) closed its connection"
        worker.process.join(timeout=FAILURE_GRACE_S)
        code = worker.process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else (
            f"exited with code {code}" if code is not None else "closed its pipe")
        return f"worker rank {worker.rank} (pid {worker.process.pid}) {how}"

    def _root_cause(self, failed: WorkerFailed) -> str:
        """A collective fails on every rank when one rank dies: name the dead one if any."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        for worker in self.workers:
            if worker.rank != failed.rank and worker.process is not None:
                worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
                if worker.process.exitcode not in (None, 0, 1):
                    return self._death_reason(worker)
        last = failed.message.strip().splitlines()[-1] if failed.message.strip() else "?"
        return f"worker rank {failed.rank} failed: {last}"

    def _fail(self, reason: str) -> None:
        self.dead = reason
        logger.error("%s; stopping the other workers", reason)
        self._finalizer()
        raise WorkerFailedError(reason)


def _without_history(out: SchedulerOutput) -> SchedulerOutput:
    """Ranks that do not sample need no token histories (penalties read them)."""
    if not any(sr.prompt_token_ids or sr.output_token_ids for sr in out.scheduled):
        return out
    return dataclasses.replace(out, scheduled=[
        dataclasses.replace(sr, prompt_token_ids=[], output_token_ids=[])
        for sr in out.scheduled])


def _stop_workers(workers: list[_Worker], grace_s: float) -> None:
    """Wait up to grace_s for spawned workers to exit, then terminate and kill what is left;
    launched workers exit when their connection closes."""
    spawned = [w.process for w in workers if w.process is not None]
    deadline = time.monotonic() + grace_s
    for process in spawned:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in spawned:
        if process.is_alive():
            process.terminate()
    for process in spawned:
        process.join(timeout=STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
    for worker in workers:
        if not worker.conn.closed:
            worker.conn.close()
