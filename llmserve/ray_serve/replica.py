"""EngineReplica: one llmserve engine as a Ray Serve replica (the Engine deployment).

The replica runs the engine exactly as `llmserve serve` does: an engine-core process behind a
local EngineCoreClient (engine/client.py). `generate` streams one request's outputs to the ingress as
lists of RequestOutputs (all that piled up since the last one); the ingress cancelling the stream (its client went away) aborts the request here,
which frees its KV blocks. Ray restarts a replica whose actor dies, or whose core process died
(the replica exits).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

from ray import serve

from llmserve.config import EngineConfig
from llmserve.engine.admission import EngineCoreRequest, EngineInfo
from llmserve.engine.client import EngineCoreClient
from llmserve.engine.outputs import RequestOutput
from llmserve.ray_serve.board import POST_INTERVAL_S, StepFigures, get_board

logger = logging.getLogger("llmserve.ray")
UNBOUNDED = 1 << 30  # Ray's max_ongoing_requests bounds a replica's queue; the ingress answers 429


class EngineReplica:
    async def __init__(self, config: EngineConfig, app_name: str, log_level: str = "info"):
        logging.getLogger("llmserve").setLevel(log_level.upper())
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.client = await asyncio.to_thread(EngineCoreClient.launch, config, log_level, UNBOUNDED)
        self.steps = StepFigures()  # since the last post
        self.client.add_step_listener(lambda step: self.steps.add(step.step_durations, step.stage_seconds))
        await self.client.start()
        self.app_name = app_name
        self.board = get_board(app_name)
        self._poster = asyncio.get_running_loop().create_task(self._post_stats())
        logger.info("engine replica %s ready (core process %d)", self.replica_id, self.client.proc.pid)

    async def info(self) -> EngineInfo:
        return self.client.info

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[list[RequestOutput]]:
        """Stream `request`'s outputs until it finishes. Raises the engine's typed error (e.g.
        EngineDeadError) when it cannot finish; a cancelled stream aborts it."""
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.client.add_request(request, queue.put_nowait)
        finished = False
        try:
            while not finished:
                outputs = []
                for item in [await queue.get()] + [queue.get_nowait() for _ in range(queue.qsize())]:
                    if isinstance(item, BaseException):
                        raise item
                    outputs.append(item)
                    finished = finished or item.finished
                yield outputs
        finally:
            if not finished:  # cancelled (the ingress's client left) or failed
                self.client.abort_request(request.request_id)

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine core died is replaced."""
        if not self.client.alive:
            raise RuntimeError(self.client.error.message if self.client.error else "the engine core has stopped")

    async def _post_stats(self) -> None:
        """Post the engine's stats every POST_INTERVAL_S; end the replica once its engine core has
        died (its requests have had their error), so that routers drop it at once instead of at
        the next failed health check."""
        while self.client.alive:
            try:
                stats = await self.client.get_stats()
                steps, self.steps = self.steps, StepFigures()
                self.board.post.remote(self.replica_id, stats, steps)
            except Exception as e:  # the board restarting: look it up again
                logger.debug("stats board: %s", e)
                self.board = get_board(self.app_name)
            await asyncio.sleep(POST_INTERVAL_S)
        logger.error("engine replica %s: %s; the replica exits", self.replica_id,
                     self.client.error.message if self.client.error else "the engine core stopped")
        await asyncio.sleep(1.0)  # the failed streams' errors reach the ingress first
        os._exit(1)

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
