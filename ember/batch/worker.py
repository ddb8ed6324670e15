"""The batch worker of one replica: claims items, runs them in the batch lane, keeps leases.

One asyncio task loops: sweep the active jobs (finish, expire, cancel; see jobs.py), renew the
leases of the items in flight, and claim more items while fewer than `max_inflight` run, as
the AdmissionGate allows: none while an interactive request waits to start, one per engine
step while interactive requests run, any number when there are none. Batch work thus takes
only room that interactive traffic leaves, and never lands on it as a burst of prefills;
the engine's scheduler (interactive admitted first, batch preempted first) protects
interactive latency from what is already running.

An item in flight is cancelled (and its engine request aborted) when its lease is lost or its
job stops. On shutdown the items in flight are cancelled and put back in the queue.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

from ember.batch.config import BatchConfig
from ember.batch.jobs import JobLifecycle, failure
from ember.batch.runner import ItemRunner, RetryLater
from ember.batch.store import BatchStore, Claim, JobRecord, Outcome

logger = logging.getLogger(__name__)

PACED_WAIT_S = 0.02  # how often to look for the next engine step while pacing admissions


class AdmissionGate:
    """How many batch items may start now, from the engine's interactive load.

    A prefill costs as much compute as many decode steps; new batch items started together
    would put one large prefill step in front of every running interactive stream. So while
    interactive requests run, items start one per engine step (`engine_steps` advancing).
    """

    def __init__(self, interactive_unstarted: Callable[[], int],
                 interactive_running: Callable[[], int], engine_steps: Callable[[], int]
                 ) -> None:
        self.interactive_unstarted = interactive_unstarted
        self.interactive_running = interactive_running
        self.engine_steps = engine_steps
        self._last_step: int | None = None

    @property
    def pacing(self) -> bool:
        return self.interactive_running() > 0

    def allow(self, free: int) -> int:
        if free <= 0 or self.interactive_unstarted() > 0:
            return 0
        if not self.pacing:
            return free
        step = self.engine_steps()
        if step == self._last_step:
            return 0
        self._last_step = step
        return 1


class BatchWorker:
    def __init__(self, store: BatchStore, lifecycle: JobLifecycle, runner: ItemRunner,
                 config: BatchConfig, models: list[str], gate: AdmissionGate,
                 on_finished: Callable[[JobRecord], None]) -> None:
        self.store = store
        self.lifecycle = lifecycle
        self.runner = runner
        self.config = config
        self.models = models
        self.gate = gate
        self.on_finished = on_finished
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.inflight: dict[asyncio.Task[None], Claim] = {}
        self._queue_empty = False  # the last claim found fewer items than it asked for
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name="ember-batch-worker")

    def wake(self) -> None:
        """Look for work now (a job was created, an item finished, a job was cancelled)."""
        self._wake.set()

    async def stop(self) -> None:
        """Stop claiming, cancel the items in flight and put them back in the queue."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        claims = list(self.inflight.values())
        for task in list(self.inflight):
            task.cancel()
        await asyncio.gather(*self.inflight, return_exceptions=True)
        for claim in claims:
            try:
                await asyncio.to_thread(self.store.release, claim)
            except Exception:  # the lease runs out and another worker takes it
                logger.exception("batch: could not release %s/%d", claim.job_id, claim.index)

    async def _loop(self) -> None:
        next_sweep = next_renew = 0.0
        while True:
            self._wake.clear()  # wakes from here on start another round at once
            now = time.monotonic()
            try:
                if now >= next_sweep:
                    next_sweep = now + self.config.poll_interval_s
                    await self._sweep()
                if now >= next_renew:
                    next_renew = now + self.config.lease_s / 3
                    await self._renew()
                await self._fill()
            except Exception:  # the store is unreachable, say: try again next round
                logger.exception("batch worker: a round failed")
            paced = (self.gate.pacing and not self._queue_empty
                     and len(self.inflight) < self.config.max_inflight)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=PACED_WAIT_S if paced
                                       else self.config.poll_interval_s)
            except TimeoutError:
                pass

    async def _sweep(self) -> None:
        active, finished = await asyncio.to_thread(self.lifecycle.sweep)
        running = {j.id for j in active if j.status == "in_progress"} - {j.id for j in finished}
        self._cancel(lambda c: c.job_id not in running)
        for job in finished:
            logger.info("batch: job %s %s (%d completed, %d failed of %d)", job.id, job.status,
                        job.completed, job.failed, job.total)
            self.on_finished(job)

    async def _renew(self) -> None:
        claims = list(self.inflight.values())
        if not claims:
            return
        lost = await asyncio.to_thread(self.store.renew, self.owner, claims)
        tokens = {c.token for c in lost}
        self._cancel(lambda c: c.token in tokens)

    def _cancel(self, which: Callable[[Claim], bool]) -> None:
        for task, claim in list(self.inflight.items()):
            if which(claim):
                task.cancel()
                del self.inflight[task]

    async def _fill(self) -> None:
        while True:
            want = self.gate.allow(self.config.max_inflight - len(self.inflight))
            if want <= 0:
                return
            claims = await asyncio.to_thread(self.store.claim, self.owner, self.models, want)
            self._queue_empty = len(claims) < want
            for claim in claims:
                if claim.attempts > self.config.max_attempts:
                    outcome = Outcome(False, failure(
                        "attempts_exhausted", f"the request could not be run in "
                        f"{self.config.max_attempts} attempts"))
                    await asyncio.to_thread(self.store.complete, claim, outcome)
                    continue
                if claim.attempts > 1:
                    logger.info("batch: %s/%d: attempt %d, an earlier claim ended unfinished",
                                claim.job_id, claim.index, claim.attempts)
                task = asyncio.create_task(self._run(claim))
                self.inflight[task] = claim
            if self._queue_empty or self.gate.pacing:
                return

    async def _run(self, claim: Claim) -> None:
        try:
            try:
                outcome = await self.runner.run(claim)
            except RetryLater as exc:
                logger.warning("batch: %s/%d goes back to the queue: %s", claim.job_id,
                               claim.index, exc)
                await asyncio.to_thread(self.store.release, claim)
                return
            await asyncio.to_thread(self.store.complete, claim, outcome)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug or the store: the lease runs out, the item is tried again
            logger.exception("batch: %s/%d failed unexpectedly", claim.job_id, claim.index)
        finally:
            self.inflight.pop(asyncio.current_task(), None)
            self.wake()
