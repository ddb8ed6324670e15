"""The engine core in a process of its own, spoken to with small typed messages over pipes.

The API process (HTTP, tokenization, detokenization) sends `CoreInput` messages; the core
answers with `CoreMessage`s. The core runs `step()` back to back while it has work, draining
its input between steps, and blocks on its input pipe when idle, so neither process ever
waits on the other. Every step's outputs carry a fresh `CoreStatus`, which is how the API
process learns KV usage, queue lengths and prefix-cache counters for /metrics.

The core exits when told to (`Shutdown`), when its input pipe closes (the API process went
away), or after reporting `CoreFailed` when the engine raises.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from ember import envs
from ember.config import EngineConfig
from ember.core.request import Lane
from ember.core.sampling_params import SamplingParams
from ember.engine.engine_core import EngineCore, EngineCoreOutput, EngineStats


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lane: Lane = Lane.INTERACTIVE
    priority: int = 0
    session_id: str | None = None


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    """Stop the loop; unfinished requests are dropped with the process."""


CoreInput = AddRequest | AbortRequests | Shutdown


@dataclass
class CoreStatus:
    """The engine's counters plus the result of the last idle-time integrity check."""

    engine: EngineStats
    integrity_checks: int = 0
    integrity_error: str | None = None


@dataclass
class CoreReady:
    pid: int
    max_model_len: int
    vocab_size: int | None
    status: CoreStatus


@dataclass
class CoreStep:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    status: CoreStatus | None = None


@dataclass
class RequestRejected:
    """EngineCore.add_request refused a request (ValueError); the message says why."""

    request_id: str
    message: str


@dataclass
class CoreFailed:
    message: str


CoreMessage = CoreReady | CoreStep | RequestRejected | CoreFailed


class _CoreLoop:
    def __init__(self, engine: EngineCore, inputs: Connection, outputs: Connection) -> None:
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.integrity_checks = 0
        self.integrity_error: str | None = None

    def status(self) -> CoreStatus:
        return CoreStatus(self.engine.stats(), self.integrity_checks, self.integrity_error)

    def run(self) -> None:
        busy_since_report = True
        while True:
            if not self.engine.has_unfinished():
                if busy_since_report:
                    self._check_integrity()
                    self.outputs.send(CoreStep(status=self.status()))
                    busy_since_report = False
                if not self._handle(self.inputs.recv()):
                    return
            while self.inputs.poll():
                if not self._handle(self.inputs.recv()):
                    return
            if self.engine.has_unfinished():
                outputs = self.engine.step()
                self.outputs.send(CoreStep(outputs, self.status()))
                busy_since_report = True

    def _handle(self, msg: CoreInput) -> bool:
        """Apply one input message; False means stop."""
        if isinstance(msg, AddRequest):
            try:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params,
                                        msg.lane, msg.priority, msg.session_id)
            except ValueError as exc:
                self.outputs.send(RequestRejected(msg.request_id, str(exc)))
        elif isinstance(msg, AbortRequests):
            self.engine.abort(msg.request_ids)
        elif isinstance(msg, Shutdown):
            return False
        else:
            raise TypeError(f"engine core: unexpected message {type(msg).__name__}")
        return True

    def _check_integrity(self) -> None:
        self.integrity_checks += 1
        try:
            self.engine.check_integrity()
        except AssertionError as exc:
            self.integrity_error = str(exc) or "integrity check failed"


def run_engine_core(config: EngineConfig, inputs: Connection, outputs: Connection) -> None:
    """Entry point of the engine-core process (multiprocessing spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when to stop
    threads = envs.num_threads()
    if threads:
        import torch

        torch.set_num_threads(threads)
    try:
        engine = EngineCore(config)
        loop = _CoreLoop(engine, inputs, outputs)
        outputs.send(CoreReady(os.getpid(), engine.max_model_len,
                               engine.checkpoint.hf_config.get("vocab_size"), loop.status()))
        loop.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the API process is gone; nobody is left to tell
    except BaseException:
        try:
            outputs.send(CoreFailed(traceback.format_exc()))
        except OSError:
            pass
        raise
    inputs.close()
    outputs.close()
    # nothing here needs finalizing, and tearing down torch's interpreter state takes seconds
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
