"""AsyncEngine: the asyncio face of an engine core running in another process.

The API process keeps the tokenizer and the OutputProcessor (detokenization, stop strings,
n > 1 fan-out); the engine core (scheduler, KV cache, model) runs in a spawned process
(core_process.py). Two threads move messages: a reader that blocks on the core's output pipe
and hands each message to the event loop, and a writer that sends queued inputs, so a slow
pipe never blocks the loop. If the core process dies, every open request fails with
EngineDeadError instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from ember.config import EngineConfig
from ember.core.request import Lane
from ember.core.sampling_params import SamplingParams
from ember.engine.core_process import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreInput,
    CoreMessage,
    CoreReady,
    CoreStatus,
    CoreStep,
    RequestRejected,
    Shutdown,
    run_engine_core,
)
from ember.engine.output_processor import OutputProcessor
from ember.engine.outputs import RequestOutput
from ember.engine.tokenizer import Tokenizer, load_tokenizer
from ember.executor.checkpoint import open_checkpoint

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can make progress."""


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput | Exception]
    lane: Lane
    started: bool = False  # has produced its first output


class AsyncEngine:
    """Submit requests with generate(), stop them with abort(); outputs arrive as they step."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, model_name: str) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_type: str | None = None  # the checkpoint's, for the tool-call format
        self.processor = OutputProcessor(tokenizer)
        self.max_model_len = 0
        self.vocab_size: int | None = None
        self.core_pid: int | None = None
        self.status: CoreStatus | None = None
        self._streams: dict[str, _Stream] = {}
        self._dead: str | None = None
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process: BaseProcess | None = None
        self._to_core: Connection | None = None
        self._from_core: Connection | None = None
        self._send_queue: queue.SimpleQueue[CoreInput | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    @classmethod
    async def launch(cls, config: EngineConfig) -> AsyncEngine:
        """Spawn the engine core, load the tokenizer meanwhile, and wait until it is ready."""
        ctx = multiprocessing.get_context("spawn")
        core_in, to_core = ctx.Pipe(duplex=False)
        from_core, core_out = ctx.Pipe(duplex=False)
        process = ctx.Process(target=run_engine_core, args=(config, core_in, core_out),
                              name="ember-engine-core")
        process.start()
        core_in.close()
        core_out.close()
        try:
            checkpoint = await asyncio.to_thread(open_checkpoint, config.model.model)
            tokenizer = await asyncio.to_thread(load_tokenizer, checkpoint)
            engine = cls(config, tokenizer, checkpoint.name)
            engine.model_type = checkpoint.hf_config.get("model_type")
            engine._process, engine._to_core, engine._from_core = process, to_core, from_core
            first = await asyncio.to_thread(_recv_or_none, from_core)
            if not isinstance(first, CoreReady):
                detail = first.message if isinstance(first, CoreFailed) else (
                    f"it exited with code {await asyncio.to_thread(_exit_code, process)}")
                raise RuntimeError(f"engine core failed to start: {detail}")
        except BaseException:
            _stop_process(process, to_core, from_core, timeout=5.0)
            raise
        engine.max_model_len = first.max_model_len
        engine.vocab_size = first.vocab_size
        engine.core_pid = first.pid
        engine.status = first.status
        engine._start_threads(asyncio.get_running_loop())
        return engine

    def _start_threads(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._threads = [threading.Thread(target=self._read_loop, name="ember-core-reader",
                                          daemon=True),
                         threading.Thread(target=self._write_loop, name="ember-core-writer",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    # ---- public API -------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._dead is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def num_unstarted(self, lanes: tuple[Lane, ...]) -> int:
        """Requests in these lanes that have not produced a token yet (the queue ahead)."""
        return sum(1 for s in self._streams.values() if not s.started and s.lane in lanes)

    def num_open_requests(self) -> int:
        return len(self._streams)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """The checks EngineCore.add_request makes, done here so errors are synchronous."""
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt_token_ids)} tokens does not fit the context of "
                             f"{self.max_model_len} tokens (the reply needs at least one)")
        vocab = self.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, lane: Lane = Lane.INTERACTIVE, priority: int = 0,
                 session_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request now; iterate the result for its outputs (deltas per step).

        Raises ValueError at once for a prompt the engine cannot take, EngineDeadError when
        the core is gone. Leaving the iteration early aborts the request; the caller must
        iterate it (or call abort) so that its KV blocks are released.
        """
        if self._dead is not None or self._closing:
            raise EngineDeadError(self._dead or "the server is shutting down")
        self.validate_prompt(prompt_token_ids)
        children = self.processor.add_request(request_id, prompt_token_ids, params, prompt)
        stream = _Stream(asyncio.Queue(), lane)
        self._streams[request_id] = stream
        for child_id, child_params in children:
            self._send(AddRequest(child_id, list(prompt_token_ids), child_params, lane, priority,
                                  session_id))
        return self._iterate(request_id, stream)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; a no-op when it already finished."""
        self._streams.pop(request_id, None)
        if not self.processor.has_request(request_id):
            return
        child_ids = self.processor.child_ids(request_id)
        self.processor.abort(request_id)
        if self._dead is None:
            self._send(AbortRequests(child_ids))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Fail what is still open, stop the core process and the message threads."""
        if self._closing:
            return
        self._closing = True
        self._fail_all("the server is shutting down")
        await asyncio.to_thread(self._close, timeout)

    # ---- internals --------------------------------------------------------------------

    async def _iterate(self, request_id: str, stream: _Stream
                       ) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def _send(self, msg: CoreInput) -> None:
        self._send_queue.put(msg)

    def _write_loop(self) -> None:
        while True:
            msg = self._send_queue.get()
            if msg is None:
                return
            try:
                self._to_core.send(msg)
            except OSError:
                return  # the reader notices the dead core

    def _read_loop(self) -> None:
        while True:
            msg = _recv_or_none(self._from_core)
            if msg is None or isinstance(msg, CoreFailed):
                if self._closing:
                    return
                reason = (f"the engine core failed: {msg.message.strip().splitlines()[-1]}"
                          if msg is not None else
                          f"the engine core process died (exit code {_exit_code(self._process)})")
                if msg is not None:
                    logger.error("engine core failed:\n%s", msg.message)
                self._call_soon(self._on_core_dead, reason)
                return
            self._call_soon(self._on_message, msg)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the event loop is closed: the server is gone

    def _on_message(self, msg: CoreMessage) -> None:
        if isinstance(msg, CoreStep):
            if msg.status is not None:
                self.status = msg.status
            if msg.outputs:
                self._deliver(msg)
        elif isinstance(msg, RequestRejected):
            self._reject(msg)

    def _deliver(self, msg: CoreStep) -> None:
        outputs, stop_early = self.processor.process(msg.outputs)
        if stop_early:
            self._send(AbortRequests(stop_early))
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.started = True
            stream.queue.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]

    def _reject(self, msg: RequestRejected) -> None:
        parent_id = next((rid for rid in self._streams
                          if msg.request_id in self.processor.child_ids(rid)), None)
        if parent_id is None:
            return
        stream = self._streams[parent_id]
        self.abort(parent_id)
        stream.queue.put_nowait(ValueError(msg.message))

    def _on_core_dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
            logger.error("%s; failing %d open requests", reason, len(self._streams))
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(reason))
        self._streams.clear()

    def _close(self, timeout: float) -> None:
        if self._dead is None:
            self._send(Shutdown())
        self._send_queue.put(None)
        reader, writer = self._threads
        writer.join(timeout=timeout / 2)
        _stop_process(self._process, self._to_core, self._from_core, timeout, reader)


def _recv_or_none(conn: Connection) -> CoreMessage | None:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _exit_code(process: BaseProcess) -> int | None:
    process.join(timeout=2.0)
    return process.exitcode


def _stop_process(process: BaseProcess, to_core: Connection, from_core: Connection,
                  timeout: float, reader: threading.Thread | None = None) -> None:
    """Wait for the core to exit after Shutdown; close its input so it sees EOF; then force."""
    process.join(timeout=timeout / 2)
    to_core.close()
    process.join(timeout=timeout / 2)
    if process.is_alive():
        logger.warning("engine core did not exit in %.0fs; terminating it", timeout)
        process.terminate()
        process.join(timeout=5.0)
    if process.is_alive():
        process.kill()
        process.join()
    if reader is not None:
        reader.join(timeout=2.0)  # it returns on the EOF the exit caused
    from_core.close()
