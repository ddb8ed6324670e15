"""The batch lane of one replica: its store, worker and webhooks, started and stopped with the
server (the app's lifespan)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from ember.batch.config import BatchConfig
from ember.batch.jobs import JobLifecycle
from ember.batch.runner import Handler, ItemRunner
from ember.batch.store import BatchStore, open_store
from ember.batch.webhook import Webhooks
from ember.batch.worker import AdmissionGate, BatchWorker
from ember.core.request import Lane
from ember.server.serving import ServerState

logger = logging.getLogger(__name__)

T = TypeVar("T")


class BatchService:
    def __init__(self, config: BatchConfig, store: BatchStore, models: list[str],
                 handlers: dict[str, Handler], gate: AdmissionGate) -> None:
        self.config = config
        self.store = store
        self.models = models
        self.webhooks = Webhooks(config)
        self.worker = BatchWorker(store, JobLifecycle(store, config.lease_s),
                                  ItemRunner(handlers), config, models, gate,
                                  self.webhooks.notify)

    @classmethod
    async def start(cls, config: BatchConfig, models: list[str], handlers: dict[str, Handler],
                    gate: AdmissionGate) -> BatchService:
        """Open the store (raises ValueError when it cannot) and start the worker."""
        store = await asyncio.to_thread(open_store, config)
        service = cls(config, store, models, handlers, gate)
        service.worker.start()
        logger.info("batch lane: store %s, worker %s, up to %d items at once",
                    config.store.split("@")[-1], service.worker.owner, config.max_inflight)
        return service

    @classmethod
    async def for_server(cls, state: ServerState, chat: Handler, completions: Handler
                         ) -> BatchService:
        """The server's batch lane: items run through its chat and completions handlers,
        admitted as the engine's interactive load allows."""
        engine = state.engine

        def running() -> int:
            return engine.status.engine.num_running_by_lane.get("interactive", 0) + \
                engine.status.engine.num_waiting_by_lane.get("interactive", 0)

        gate = AdmissionGate(lambda: engine.num_unstarted((Lane.INTERACTIVE,)), running,
                             lambda: engine.status.engine.num_steps)
        return await cls.start(state.config.batch, state.model_names,
                               {"/v1/chat/completions": chat, "/v1/completions": completions},
                               gate)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A store call, off the event loop."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def stop(self) -> None:
        await self.worker.stop()
        await self.webhooks.close()
        await asyncio.to_thread(self.store.close)
