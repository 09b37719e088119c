"""RayEngineClient: the engine door (engine/client.EngineDoor) over Ray Serve engine replicas.

  add_request(req, sink) -> a task per request: handle.generate.remote(req) (streaming, routed by
                            the deployment's request router) -> each ReplicaChunk's outputs to sink
  abort_request(id)      -> cancels that stream; the replica aborts the request
  stats                  -> the replicas' EngineStats from the StatsBoard, summed

Same invariants as the local door: every accepted request's sink gets outputs until one is
finished, or one exception. A replica that dies fails only its own requests, with a 503
EngineDeadError ("replica_failed"); a request that fails before its first output (it never
reached a live engine) is sent again, up to RETRIES times, so new requests go to live replicas.
`error` stays None: the engine as a whole does not die while Ray keeps replicas running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from ray.exceptions import RayTaskError

from llmserve.config import EngineConfig
from llmserve.engine.admission import EngineCoreRequest, EngineInfo, make_core_request
from llmserve.engine.client import Sink
from llmserve.engine.messages import StepOutputs
from llmserve.engine.outputs import EngineStats, RequestOutput
from llmserve.errors import EngineDeadError, EngineOverloadedError, LLMServeError
from llmserve.profiling import STAGES
from llmserve.ray_serve.board import READ_INTERVAL_S, get_board, sum_stats
from llmserve.ray_serve.replica import ReplicaChunk
from llmserve.sampling import SamplingParams

logger = logging.getLogger("llmserve.ray")
RETRIES = 2


class RayEngineClient:
    def __init__(self, handle, config: EngineConfig, info: EngineInfo, app_name: str,
                 max_waiting: int = 256, max_waiting_tokens: int | None = None):
        self.handle = handle.options(stream=True)  # DeploymentHandle of the Engine deployment
        self.config, self.info, self.app_name = config, info, app_name
        self.max_waiting, self.max_waiting_tokens = max_waiting, max_waiting_tokens
        self.sinks: dict[str, Sink] = {}  # in flight: request_id -> where its outputs go
        self.step_listeners: list[Callable[[StepOutputs], None]] = []  # run per chunk received
        self.error: EngineDeadError | None = None
        self._empty = EngineStats(0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0)
        self.stats = self._empty
        self._replicas: dict[str, EngineStats] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._unstarted: dict[str, int] = {}  # request id -> prompt tokens, until its first output
        self._num_output: dict[str, int] = {}  # request id -> output tokens so far
        self._board = get_board(app_name)
        self._reader: asyncio.Task | None = None
        self._closing = False

    @classmethod
    async def connect(cls, handle, config: EngineConfig, app_name: str, **limits) -> RayEngineClient:
        """Ask a replica for the engine's fixed limits (waits until one is up)."""
        info = await handle.info.remote()
        return cls(handle, config, info, app_name, **limits)

    async def start(self) -> None:
        await self._read_board()
        self._reader = asyncio.get_running_loop().create_task(self._follow_board())

    async def shutdown(self, timeout: float = 10.0) -> None:
        self.close()
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks, timeout=timeout) if tasks else None

    def close(self) -> None:
        self._closing = True
        if self._reader is not None:
            self._reader.cancel()

    @property
    def alive(self) -> bool:
        return not self._closing

    # ---- requests ---------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float) -> EngineCoreRequest:
        return make_core_request(self.info, request_id, prompt_token_ids, params, arrival_time)

    def num_waiting(self) -> int:
        """Requests sent that have no output yet (queued in the router or in a replica)."""
        return len(self._unstarted)

    def add_request(self, req: EngineCoreRequest, sink: Sink) -> None:
        if self._closing:
            raise EngineDeadError("the server is shutting down")
        tokens_waiting = sum(self._unstarted.values())
        if self.num_waiting() >= self.max_waiting or (
            self.max_waiting_tokens is not None and tokens_waiting + len(req.prompt_token_ids) > self.max_waiting_tokens
        ):
            raise EngineOverloadedError(f"the server is overloaded ({self.num_waiting()} requests waiting); retry later")
        rid = req.request_id
        self.sinks[rid] = sink
        self._unstarted[rid] = len(req.prompt_token_ids)
        self._num_output[rid] = 0
        self._tasks[rid] = asyncio.get_running_loop().create_task(self._stream(req))

    def abort_request(self, request_id: str) -> None:
        """The caller has gone: forget its sink; cancelling the stream aborts it in its replica."""
        self.sinks.pop(request_id, None)
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    def abort_all(self) -> None:
        """Each stream ends with a final "abort" output, then its replica aborts it."""
        for rid in list(self.sinks):
            sink = self.sinks.pop(rid)
            sink(RequestOutput(rid, [], "", [], True, "abort", None, 0, self._num_output.get(rid, 0), 0, time.time()))
            self.abort_request(rid)

    async def get_stats(self) -> EngineStats:
        await self._read_board()
        return self.stats

    def replica_stats(self) -> dict[str, EngineStats]:
        return dict(self._replicas)

    # ---- streams ----------------------------------------------------------------------------

    async def _stream(self, req: EngineCoreRequest) -> None:
        rid = req.request_id
        try:
            for attempt in range(RETRIES + 1):
                started = False
                stream = self.handle.generate.remote(req)
                try:
                    async for chunk in stream:
                        started = True
                        if self._deliver(rid, chunk):
                            return
                    raise EngineDeadError("the engine replica ended the stream before the request finished")
                except asyncio.CancelledError:
                    stream.cancel()
                    raise
                except Exception as e:  # the replica failed, or refused the request
                    error = _typed(e)
                    if started or attempt == RETRIES or isinstance(error, LLMServeError) and error.status_code < 500:
                        self._fail(rid, error)
                        return
                    logger.warning("request %s: engine replica failed before its first output (%s); sending it again",
                                   rid, error)
        finally:
            for d in (self._tasks, self._unstarted, self._num_output):
                d.pop(rid, None)

    def _deliver(self, rid: str, chunk: ReplicaChunk) -> bool:
        """Hand a chunk's outputs to the request's sink; True once it finished."""
        self._unstarted.pop(rid, None)
        finished = False
        for o in chunk.outputs:
            self._num_output[rid] = o.num_output_tokens
            finished = o.finished
            sink = self.sinks.pop(rid, None) if finished else self.sinks.get(rid)
            if sink is not None:
                sink(o)
        step = StepOutputs(chunk.outputs, self.stats, [], 0, 0, [], [0.0] * len(STAGES))
        for listener in self.step_listeners:
            listener(step)
        return finished

    def _fail(self, rid: str, error: BaseException) -> None:
        sink = self.sinks.pop(rid, None)
        if sink is not None:
            sink(error)

    # ---- stats ------------------------------------------------------------------------------

    async def _read_board(self) -> None:
        with contextlib.suppress(Exception):  # the board restarting: keep the last figures
            self._replicas = await self._board.read.remote()
            self.stats = sum_stats(list(self._replicas.values()), self._empty)

    async def _follow_board(self) -> None:
        while True:
            await asyncio.sleep(READ_INTERVAL_S)
            await self._read_board()


def _typed(e: Exception) -> BaseException:
    """A replica's typed error as it was raised there; anything else as a 503 for this request."""
    cause = e.cause if isinstance(e, RayTaskError) else e
    if isinstance(cause, LLMServeError):
        return cause
    why = f"{type(cause).__name__}: {cause}".splitlines()[0][:300]
    return EngineDeadError(f"the engine replica serving this request failed ({why})", code="replica_failed")
