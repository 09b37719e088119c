"""RayEngineClient: the engine door (engine/client.EngineClient) over Ray Serve engine replicas.

  add_request(req, sink) -> a task per request: handle.generate.remote(req) (streaming, routed by
                            the deployment's request router) -> each list of outputs to sink
  abort_request(id)      -> cancels that stream; the replica aborts the request
  get_stats()            -> the replicas' EngineStats from the StatsBoard, summed
  step listeners         -> a StepEvent per chunk of outputs, and per board read (the steps' times)

Same invariants as the local door: every accepted request's sink gets outputs until one is
finished, or one exception. A replica that dies fails only its own requests, with a 503
EngineDeadError ("replica_failed"); a request that fails before its first output (it never
reached a live engine) is sent again, up to RETRIES times, so new requests go to live replicas.
`error` stays None: the engine as a whole does not die while Ray keeps replicas running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ray.exceptions import RayTaskError
from ray.serve.context import _set_request_context

from llmserve.config import EngineConfig
from llmserve.engine.admission import EngineCoreRequest, EngineInfo, make_core_request
from llmserve.engine.client import InFlight, Sink, StepListener, StepListeners
from llmserve.engine.outputs import EngineStats, RequestOutput, StepEvent
from llmserve.errors import EngineDeadError, LLMServeError
from llmserve.lora.request import LoRARequest
from llmserve.ray_serve.board import READ_INTERVAL_S, get_board, sum_stats
from llmserve.sampling import SamplingParams

logger = logging.getLogger("llmserve.ray")
RETRIES = 2


@dataclass(slots=True)
class Stream:
    """One request sent to the Engine deployment."""

    task: asyncio.Task | None  # streams its outputs to the sink
    prompt_tokens: int
    started: bool = False  # an output has come
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


class RayEngineClient:
    def __init__(self, handle, config: EngineConfig, info: EngineInfo, app_name: str,
                 max_waiting: int = 256, max_waiting_tokens: int | None = None):
        self.handle = handle.options(stream=True)  # DeploymentHandle of the Engine deployment
        self.config, self.info, self.app_name = config, info, app_name
        self.requests = InFlight(max_waiting, max_waiting_tokens)
        self.listeners = StepListeners()  # run per chunk received and per board read
        self.error: EngineDeadError | None = None
        self._empty = EngineStats.idle()
        self._stats = self._empty  # summed over the replicas, as of the last board read
        self._replicas: dict[str, EngineStats] = {}  # as last posted on the board
        self._retired: dict[str, EngineStats] = {}  # replicas gone from the board: their counters still count
        self._requests: dict[str, Stream] = {}
        self._board = None  # the StatsBoard actor, from start()
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
        tasks = [r.task for r in self._requests.values() if r.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def close(self) -> None:
        self._closing = True
        if self._reader is not None:
            self._reader.cancel()

    @property
    def alive(self) -> bool:
        return not self._closing

    # ---- requests ---------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float,
                     priority: int = 0, lora_request: LoRARequest | None = None) -> EngineCoreRequest:
        return make_core_request(self.info, request_id, prompt_token_ids, params, arrival_time, priority, lora_request)

    def add_request(self, req: EngineCoreRequest, sink: Sink) -> None:
        if self._closing:
            raise EngineDeadError("the server is shutting down")
        self.requests.admit(req, sink)
        rid = req.request_id
        record = self._requests[rid] = Stream(None, len(req.prompt_token_ids))
        record.task = asyncio.get_running_loop().create_task(self._stream(req, record))
        # also when the task is cancelled before it ever ran (its `finally` would not)
        record.task.add_done_callback(lambda _: self._requests.pop(rid, None))

    def abort_request(self, request_id: str) -> None:
        """The caller has gone: forget its sink; cancelling the stream aborts it in its replica."""
        if self.requests.forget(request_id):
            self.listeners.emit(StepEvent([], self.stats))
        record = self._requests.get(request_id)
        if record is not None and record.task is not None:
            record.task.cancel()

    def abort_all(self) -> int:
        """Each stream ends with a final "abort" output, then its replica aborts it."""
        rids = list(self.requests.sinks)
        for rid in rids:
            r = self._requests.get(rid) or Stream(None, 0)
            self._deliver([RequestOutput(rid, [], "", [], True, "abort", None, r.prompt_tokens, r.num_output_tokens,
                                         r.num_cached_tokens, time.time())])
            self.abort_request(rid)
        return len(rids)

    def num_in_flight(self) -> int:
        return len(self.requests)

    def add_step_listener(self, listener: StepListener) -> Callable[[], None]:
        return self.listeners.add(listener)

    async def get_stats(self) -> EngineStats:
        await self._read_board()
        return self.stats

    @property
    def stats(self) -> EngineStats:
        """As of the last board read, with the front end's queue depth."""
        return self.requests.stats(self._stats)

    def replica_stats(self) -> dict[str, EngineStats]:
        return dict(self._replicas)

    # ---- streams ----------------------------------------------------------------------------

    async def _stream(self, req: EngineCoreRequest, record: Stream) -> None:
        """Send `req` (again, while it failed before its first output) and pass its outputs on."""
        for attempt in range(RETRIES + 1):
            stream = None
            try:
                # a Serve request of its own: child calls otherwise share the HTTP request's internal
                # id, and Ray's router (matching routed replicas to requests by that id) would serve
                # one of the n samples of a request and leave the others waiting
                _set_request_context(_internal_request_id=f"{req.request_id}:{attempt}")
                stream = self.handle.generate.remote(req)
                async for outputs in stream:
                    if self._deliver(outputs, record):
                        return
                raise EngineDeadError("the engine replica ended the stream before the request finished")
            except asyncio.CancelledError:
                if stream is not None:
                    stream.cancel()
                if asyncio.current_task().cancelling() == 0:  # Ray cancelled it, not abort_request
                    self._fail(req.request_id, EngineDeadError("the request was cancelled", code="replica_failed"))
                raise
            except Exception as e:  # the replica failed, or refused the request
                if stream is not None:
                    stream.cancel()  # a replica that is only slow to answer must not run it twice
                error = _typed(e)
                if record.started or attempt == RETRIES or isinstance(error, LLMServeError) and error.status_code < 500:
                    self._fail(req.request_id, error)
                    return
                logger.warning("request %s: engine replica failed before its first output (%s); sending it again",
                               req.request_id, error)

    def _deliver(self, outputs: list[RequestOutput], record: Stream | None = None) -> bool:
        """Hand outputs of one request to its sink, then to the step listeners; True once it finished."""
        finished = False
        for o in outputs:
            if record is not None:
                record.started = True
                record.num_output_tokens, record.num_cached_tokens = o.num_output_tokens, o.num_cached_tokens
            finished = finished or o.finished
            self.requests.deliver(o)
        self.listeners.emit(StepEvent(outputs, self.stats))
        return finished

    def _fail(self, rid: str, error: BaseException) -> None:
        self.requests.fail(rid, error)
        self.listeners.emit(StepEvent([], self.stats))

    # ---- stats ------------------------------------------------------------------------------

    async def _read_board(self) -> None:
        try:
            self._board = self._board or get_board(self.app_name)
            posted, steps = await self._board.read.remote()
        except Exception as e:  # the board restarting: keep the last figures, look it up again next time
            logger.debug("stats board: %s", e)
            self._board = None
            return
        for gone in set(self._replicas) - set(posted):
            self._retired[gone] = self._replicas[gone]
        for back in set(posted) & set(self._retired):
            del self._retired[back]
        self._replicas = posted
        self._stats = sum_stats(list(posted.values()), list(self._retired.values()), self._empty)
        # every read: the gauges follow replicas that come, go or idle; the steps' times, if any
        self.listeners.emit(StepEvent([], self.stats, steps.durations, steps.stage_seconds))

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
