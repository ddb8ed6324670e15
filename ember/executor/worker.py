"""One worker process per rank: joins the process group, loads its shard of the model, keeps
its KV cache, and runs the steps the engine core sends it.

The engine core talks to each worker over a connection with the small typed messages below;
tensors move only between workers, inside torch.distributed collectives. Every rank answers
every step (the first rank of each tensor-parallel group with the sampled tokens), so the
engine core notices a failed rank at the next step. A worker exits when told to, when its
connection closes, or when its parent process disappears.

Workers are spawned by the engine on its host, or started by a launcher on every host:

    EMBER_WORKER_AUTHKEY=secret torchrun --nnodes 2 --nproc-per-node 8 \
        --master-addr head --master-port 29500 -m ember.executor.worker --engine head:5555

(torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK), against an engine
started with `--worker-launcher external --worker-listen 0.0.0.0:5555` and the same key.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection

import torch

from ember import envs
from ember.config import EngineConfig
from ember.core.scheduler import SchedulerOutput
from ember.distributed.layout import RankLayout
from ember.distributed.parallel_state import ParallelContext, init_distributed
from ember.executor.checkpoint import open_checkpoint
from ember.executor.model_runner import ModelRunner, StepResult

PARENT_POLL_S = 1.0
CONNECT_TIMEOUT_S = 120.0  # how long a launched worker retries reaching the engine


# ---- engine core -> worker -------------------------------------------------------------------

@dataclass
class ExecuteStep:
    out: SchedulerOutput  # this rank's data-parallel group's share of the step
    any_work: bool  # some data-parallel group has tokens this step


@dataclass
class GatherExpertLoad:
    """Sum each MoE layer's per-slot token counts over the ranks (and reset them)."""


@dataclass
class ApplyPlacement:
    placements: dict[int, list[int]]  # MoE layer index -> slot -> expert


@dataclass
class ShutdownWorker:
    """Leave the loop and exit."""


WorkerInput = ExecuteStep | GatherExpertLoad | ApplyPlacement | ShutdownWorker


@dataclass
class WorkerAssignment:
    """The engine's answer to a launched worker's WorkerHello: what to load and run."""

    config: EngineConfig


# ---- worker -> engine core -------------------------------------------------------------------

@dataclass
class WorkerHello:
    """A launched worker's first message: who it is."""

    rank: int
    world_size: int
    pid: int
    host: str


@dataclass
class WorkerReady:
    rank: int
    pid: int
    num_kv_blocks: int
    kv_bytes_per_token: int
    param_bytes: int  # parameters resident in this process
    bytes_read: int  # checkpoint bytes this rank read while loading
    placements: dict[int, list[int]]  # expert-parallel MoE layers: slot -> expert


@dataclass
class StepDone:
    result: StepResult | None  # the sampled tokens, from the first rank of a TP group
    step_seconds: float  # totals since the worker started
    comm_seconds: float


@dataclass
class ExpertLoad:
    slot_load: dict[int, list[int]]  # MoE layer index -> tokens per physical slot


@dataclass
class PlacementApplied:
    """The new expert placement is in force."""


@dataclass
class WorkerFailed:
    rank: int
    message: str  # the traceback


WorkerMessage = WorkerReady | StepDone | ExpertLoad | PlacementApplied | WorkerFailed


def worker_device(config: EngineConfig, layout: RankLayout) -> torch.device:
    """CPU ranks share the CPU; GPU ranks take one device each (LOCAL_RANK under torchrun)."""
    device = torch.device(config.model.device)
    if device.type != "cuda":
        return device
    local = envs.local_rank()
    index = local if local is not None else layout.rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class Worker:
    def __init__(self, runner: ModelRunner, parallel: ParallelContext, conn: Connection) -> None:
        self.runner = runner
        self.parallel = parallel
        self.conn = conn
        self.step_seconds = 0.0
        # MoE layers exchange tokens across data-parallel groups: every group must run every
        # step that has work somewhere, with an empty batch if need be
        self.lockstep = parallel.layout.data_parallel_size > 1 and runner.has_moe

    def run(self) -> None:
        while True:
            msg = self.conn.recv()
            if isinstance(msg, ExecuteStep):
                start = time.perf_counter()
                result = self.runner.execute(msg.out, lockstep=self.lockstep and msg.any_work)
                self.step_seconds += time.perf_counter() - start
                self.conn.send(StepDone(result if self.runner.is_driver else None,
                                        self.step_seconds, self.parallel.stats.seconds))
            elif isinstance(msg, GatherExpertLoad):
                self.conn.send(ExpertLoad({i: block.gather_slot_load()
                                           for i, block in self.runner.ep_blocks().items()}))
            elif isinstance(msg, ApplyPlacement):
                blocks = self.runner.ep_blocks()
                for i, placement in sorted(msg.placements.items()):
                    blocks[i].apply_placement(placement)
                self.conn.send(PlacementApplied())
            elif isinstance(msg, ShutdownWorker):
                return
            else:
                raise TypeError(f"worker: unexpected message {type(msg).__name__}")


def _exit_with_parent() -> None:
    """Exit when the engine core goes away, even if this rank is blocked in a collective."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="ember-parent-watch", daemon=True).start()


def run_worker(rank: int, config: EngineConfig, init_method: str, conn: Connection) -> None:
    """Entry point of a worker process (multiprocessing spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when to stop
    _exit_with_parent()
    threads = envs.num_threads()
    if threads:
        torch.set_num_threads(threads)
    code = 0
    try:
        p = config.parallel
        layout = RankLayout(rank, p.tensor_parallel_size, p.data_parallel_size,
                            p.expert_parallel_size)
        device = worker_device(config, layout)
        parallel = init_distributed(layout, init_method, device, p.backend, p.worker_timeout_s)
        parallel.num_redundant_experts = p.num_redundant_experts
        runner = ModelRunner(open_checkpoint(config.model.model), config, parallel, device)
        conn.send(WorkerReady(rank, os.getpid(), runner.num_kv_blocks, runner.kv_bytes_per_token,
                              runner.param_bytes, runner.bytes_read.bytes,
                              {i: b.placement for i, b in runner.ep_blocks().items()}))
        Worker(runner, parallel, conn).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the engine core is gone
    except BaseException:
        code = 1
        try:
            conn.send(WorkerFailed(rank, traceback.format_exc()))
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    # peers may be mid-collective with this rank: skip process-group teardown and torch's
    # seconds-long interpreter shutdown
    os._exit(code)


def connect_to_engine(address: tuple[str, int], authkey: bytes) -> Connection:
    """Reach the engine's worker listener, retrying while it starts."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return Client(address, authkey=authkey)
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    """A worker started by a launcher: rank and rendezvous from the environment, the model
    and parallel layout from the engine it connects to."""
    parser = argparse.ArgumentParser(prog="python -m ember.executor.worker",
                                     description=main.__doc__)
    parser.add_argument("--engine", required=True, metavar="HOST:PORT",
                        help="the engine's --worker-listen address")
    args = parser.parse_args(argv)
    dist_env, authkey = envs.launcher_rank(), envs.worker_authkey()
    if dist_env is None or authkey is None:
        print("ember worker: needs RANK and WORLD_SIZE (set by torchrun) and "
              "EMBER_WORKER_AUTHKEY", file=sys.stderr)
        return 2
    host, _, port = args.engine.rpartition(":")
    conn = connect_to_engine((host, int(port)), authkey)
    rank, world_size = dist_env
    conn.send(WorkerHello(rank, world_size, os.getpid(), socket.gethostname()))
    assignment: WorkerAssignment = conn.recv()
    run_worker(rank, assignment.config, "env://", conn)
    return 0


if __name__ == "__main__":
    # re-import under the package name, so pickled messages name ember.executor.worker classes
    from ember.executor.worker import main as worker_main

    sys.exit(worker_main())
