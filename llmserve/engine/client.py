"""The door between the server and the engine: the EngineClient protocol (below; vLLM's name for
it), and EngineCoreClient, its implementation over one engine core in its own OS process
(engine/engine_core.py; vLLM's EngineCoreClient). This side holds no engine state, only what
crossed the pipe.

  server (asyncio loop)                                     engine-core process
  add_request(req, sink) --AddRequest / AbortRequests-->    step loop
  sink(RequestOutput)    <--StepOutputs (one per step)--    (every request's new tokens)

The door: `info` (fixed limits), `make_request` (validation, typed 4xx), `add_request`,
`abort_request` / `abort_all`, `await get_stats()` (asked for), the outputs, delivered to each
request's sink on the loop thread, and StepEvents (engine/outputs.py) for whoever watches steps
(metrics, the dashboard). The queue depth is counted once, here in the front end (InFlight).

Invariants: every accepted request's sink gets outputs until one is `finished`, or one exception
(EngineDeadError when the core process dies); `abort_request` (the caller has gone) forgets the
sink at once; `abort_all` (drain) lets each stream see its final "abort" output. All methods but
`launch` and `close` run on the event loop thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Protocol

from llmserve import errors
from llmserve.config import EngineConfig
from llmserve.engine.admission import EngineCoreRequest, EngineInfo, make_core_request
from llmserve.engine.messages import (
    AbortRequests,
    AddRequest,
    BadFrame,
    Configure,
    FrameReader,
    FromCore,
    GetStats,
    Ready,
    Shutdown,
    StartupFailed,
    StatsReply,
    StepOutputs,
    frame,
    read_available,
    write_all,
)
from llmserve.engine.outputs import EngineStats, RequestOutput, StepEvent
from llmserve.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from llmserve.lora.request import LoRARequest
from llmserve.sampling import SamplingParams

__all__ = ["EngineCoreClient", "EngineCoreRequest", "EngineClient", "EngineInfo", "EngineStats", "RequestOutput", "StepEvent"]

logger = logging.getLogger("llmserve.engine")
Sink = Callable[[RequestOutput | BaseException], None]
StepListener = Callable[[StepEvent], None]
STATS_TIMEOUT_S = 10.0


class EngineClient(Protocol):
    """What the server needs of an engine. Two implementations: EngineCoreClient (below: one engine
    core in a child process) and RayEngineClient (llmserve/ray_serve/client.py: engine replicas
    on a Ray cluster). The invariants in this module's docstring hold for both."""

    config: EngineConfig
    info: EngineInfo
    error: EngineDeadError | None  # set once the engine as a whole is gone (never for one replica)

    @property
    def alive(self) -> bool: ...
    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float,
                     priority: int = 0, lora_request: LoRARequest | None = None) -> EngineCoreRequest: ...
    def add_request(self, req: EngineCoreRequest, sink: Sink) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def abort_all(self) -> int: ...  # how many were in flight
    def num_in_flight(self) -> int: ...  # accepted, not yet finished (a drain waits for 0)
    async def get_stats(self) -> EngineStats: ...  # fresh, summed over replicas
    def replica_stats(self) -> dict[str, EngineStats]: ...  # per engine replica; {} for one engine
    def add_step_listener(self, listener: StepListener) -> Callable[[], None]: ...  # returns: remove it
    async def start(self) -> None: ...
    async def shutdown(self, timeout: float = 10.0) -> None: ...
    def close(self) -> None: ...


class InFlight:
    """The front end's requests in flight, counted once (both doors use it): each one's sink, and
    those still without a first output (queued, loading or in prefill) with their prompt tokens,
    which the 429 limits bound. The waiting count the stats report is what is in flight and not
    running in the engine (on its way, queued, loading its prefix, or preempted): waiting(running)."""

    def __init__(self, max_waiting: int, max_waiting_tokens: int | None):
        self.max_waiting, self.max_waiting_tokens = max_waiting, max_waiting_tokens
        self.sinks: dict[str, Sink] = {}  # request_id -> where its outputs go
        self.waiting: dict[str, int] = {}  # request_id -> prompt tokens, until its first output
        self.waiting_tokens = 0

    def __len__(self) -> int:
        return len(self.sinks)

    @property
    def num_waiting(self) -> int:
        """Requests without a first output yet (the 429 limits count these)."""
        return len(self.waiting)

    def stats(self, engine: EngineStats) -> EngineStats:
        """`engine`'s stats with num_waiting = in flight and not among its num_running."""
        return engine.with_waiting(max(0, len(self.sinks) - engine.num_running))

    def admit(self, req: EngineCoreRequest, sink: Sink) -> None:
        """Register `req`, or raise EngineOverloadedError (429) when too many requests or prompt
        tokens would wait."""
        n = len(req.prompt_token_ids)
        if len(self.waiting) >= self.max_waiting or (
            self.max_waiting_tokens is not None and self.waiting_tokens + n > self.max_waiting_tokens
        ):
            raise EngineOverloadedError(f"the server is overloaded ({len(self.waiting)} requests waiting); retry later")
        self.sinks[req.request_id] = sink
        self.waiting[req.request_id] = n
        self.waiting_tokens += n

    def deliver(self, output: RequestOutput) -> None:
        """Hand `output` to its request's sink; a finished request's sink is forgotten."""
        rid = output.request_id
        self._started(rid)
        sink = self.sinks.pop(rid, None) if output.finished else self.sinks.get(rid)
        if sink is not None:
            sink(output)

    def fail(self, request_id: str, error: BaseException) -> None:
        sink = self.sinks.get(request_id)
        self.forget(request_id)
        if sink is not None:
            sink(error)

    def forget(self, request_id: str) -> bool:
        """False when it was not in flight."""
        self._started(request_id)
        return self.sinks.pop(request_id, None) is not None

    def _started(self, request_id: str) -> None:
        n = self.waiting.pop(request_id, None)
        if n is not None:
            self.waiting_tokens -= n


class StepListeners(list[StepListener]):
    def add(self, listener: StepListener) -> Callable[[], None]:
        self.append(listener)
        return lambda: self.remove(listener)

    def emit(self, event: StepEvent) -> None:
        """Each listener in turn; one that fails is logged and never stops the outputs' delivery."""
        for listener in self:
            try:
                listener(event)
            except Exception:
                logger.exception("a step listener failed")


class EngineCoreClient:
    def __init__(self, config: EngineConfig, proc: subprocess.Popen, to_core: int, from_core: int, reader: FrameReader,
                 info: EngineInfo, max_waiting: int = 256, max_waiting_tokens: int | None = None):
        self.proc, self.to_core, self.from_core, self.reader = proc, to_core, from_core, reader
        self.config = config  # what the core was started with
        self.info = info
        self.requests = InFlight(max_waiting, max_waiting_tokens)
        self.listeners = StepListeners()  # run on the loop, per step and per request added or aborted
        self.error: EngineDeadError | None = None
        self._engine_stats = EngineStats.idle(info.num_kv_blocks)  # the core's, as of its last step
        self._calls = itertools.count()
        self._stats_calls: dict[int, asyncio.Future[EngineStats]] = {}
        self._writer: asyncio.WriteTransport | None = None
        self._closing = False

    # ---- life cycle -------------------------------------------------------------------------

    @classmethod
    def launch(cls, config: EngineConfig, log_level: str = "info", max_waiting: int = 256,
               max_waiting_tokens: int | None = None) -> EngineCoreClient:
        """Start the core process and wait (blocking) until its engine is ready; a start-up
        failure raises its typed error (e.g. ModelLoadError) here."""
        core_in, to_core = os.pipe()
        from_core, core_out = os.pipe()
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmserve.engine.engine_core", str(core_in), str(core_out)],
            pass_fds=(core_in, core_out), stdin=subprocess.DEVNULL,
        )
        os.close(core_in)
        os.close(core_out)
        try:
            write_all(to_core, frame(Configure(config, log_level)))
            reader = FrameReader(FromCore)
            info = _wait_ready(proc, from_core, reader)
        except BaseException:
            _stop(proc)
            os.close(to_core)
            os.close(from_core)
            raise
        logger.info("engine core process %d ready", proc.pid)
        return cls(config, proc, to_core, from_core, reader, info, max_waiting, max_waiting_tokens)

    async def start(self) -> None:
        """Attach to the running event loop: outputs flow from here on."""
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: _FromCoreProtocol(self), os.fdopen(self.from_core, "rb", buffering=0))
        self._writer, _ = await loop.connect_write_pipe(asyncio.BaseProtocol, os.fdopen(self.to_core, "wb", buffering=0))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core process (it exits at once; abort what is in flight first)."""
        self._closing = True
        if self.alive:
            self._send(Shutdown())
        try:
            await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            logger.warning("engine core process %d did not stop in %.0fs: killed", self.proc.pid, timeout)
        self.close()

    def close(self) -> None:
        """Synchronous last resort (any thread): kill the core process if it still runs."""
        self._closing = True
        _stop(self.proc)

    @property
    def alive(self) -> bool:
        return self.error is None and self.proc.poll() is None

    # ---- requests ---------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float,
                     priority: int = 0, lora_request: LoRARequest | None = None) -> EngineCoreRequest:
        """Validate against the engine's limits (typed errors); nothing is sent yet."""
        return make_core_request(self.info, request_id, prompt_token_ids, params, arrival_time, priority, lora_request)

    def add_request(self, req: EngineCoreRequest, sink: Sink) -> None:
        """Send `req`; its outputs go to `sink`. Raises EngineDeadError or EngineOverloadedError (429)."""
        if self.error is not None:
            raise self.error
        if self._closing:
            raise EngineDeadError("the server is shutting down")
        self.requests.admit(req, sink)
        self._send(AddRequest(req))
        self._emit([])

    def abort_request(self, request_id: str) -> None:
        """The caller has gone: forget its sink and free the request's blocks in the core."""
        if self.requests.forget(request_id):
            if self.alive:
                self._send(AbortRequests([request_id]))
            self._emit([])

    def abort_all(self) -> int:
        """Abort everything in flight; each sink still gets its final ("abort") output."""
        if self.requests and self.alive:
            self._send(AbortRequests(list(self.requests.sinks)))
        return len(self.requests)

    def num_in_flight(self) -> int:
        return len(self.requests)

    def add_step_listener(self, listener: StepListener) -> Callable[[], None]:
        return self.listeners.add(listener)

    async def get_stats(self) -> EngineStats:
        """The core's stats now (KV-store counters and memory included), not as of the last step."""
        if self.error is not None:
            raise self.error
        call_id = next(self._calls)
        future = asyncio.get_running_loop().create_future()
        self._stats_calls[call_id] = future
        self._send(GetStats(call_id))
        try:
            stats = await asyncio.wait_for(future, STATS_TIMEOUT_S)
        finally:
            self._stats_calls.pop(call_id, None)
        return self.requests.stats(stats)

    def replica_stats(self) -> dict[str, EngineStats]:
        return {}  # one engine

    def _emit(self, outputs: list[RequestOutput], durations: list[float] | None = None,
              stages: list[float] | None = None) -> None:
        self.listeners.emit(StepEvent(outputs, self.requests.stats(self._engine_stats), durations or [], stages or []))

    def _send(self, msg: object) -> None:
        assert self._writer is not None, "EngineCoreClient.start() has not run"
        self._writer.write(frame(msg))

    # ---- from the core (loop thread) --------------------------------------------------------

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, StepOutputs):
            self._on_step(msg)
        elif isinstance(msg, BadFrame):  # outputs lost: end everything cleanly rather than hang
            logger.error("unreadable message from the engine core (%s): stopping it", msg.error)
            self.proc.kill()
        elif isinstance(msg, StatsReply):
            future = self._stats_calls.get(msg.call_id)
            if future is not None and not future.done():
                future.set_result(msg.stats)

    def _on_step(self, step: StepOutputs) -> None:
        for rid, message in step.rejected:
            self.requests.fail(rid, InvalidRequestError(message))
        for o in step.outputs:
            self.requests.deliver(o)
        self._engine_stats = step.stats
        self._emit(step.outputs, step.step_durations, step.stage_seconds)

    def _on_core_gone(self) -> None:
        """The pipe from the core closed: at shutdown, expected; otherwise the core died."""
        if self._closing or self.error is not None:
            return
        try:
            code = self.proc.wait(1.0)  # the pipe closes as the process exits
        except subprocess.TimeoutExpired:
            code = None
        how = f"exit code {code}" if code is not None and code >= 0 else f"signal {-code}" if code else "unknown cause"
        self.error = EngineDeadError(f"the engine core process died ({how})", code="engine_dead")
        logger.error("%s; failing %d request(s)", self.error.message, len(self.requests))
        for rid in list(self.requests.sinks):
            self.requests.fail(rid, self.error)
        for future in self._stats_calls.values():
            if not future.done():
                future.set_exception(self.error)


class _FromCoreProtocol(asyncio.Protocol):
    def __init__(self, client: EngineCoreClient):
        self.client = client

    def data_received(self, data: bytes) -> None:
        for msg in self.client.reader.feed(data):
            self.client._dispatch(msg)

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._on_core_gone()


def _wait_ready(proc: subprocess.Popen, from_core: int, reader: FrameReader) -> EngineInfo:
    """Block until the core says Ready (its EngineInfo) or StartupFailed (raised, typed)."""
    while True:
        got = read_available(from_core, reader, 1.0)
        if got is None:
            raise EngineDeadError(f"the engine core process exited during start-up (exit code {proc.wait()})")
        for msg in got:
            if isinstance(msg, Ready):
                return msg.info
            if isinstance(msg, StartupFailed):
                cls = getattr(errors, msg.error_type, None)
                if isinstance(cls, type) and issubclass(cls, errors.LLMServeError):
                    raise cls(msg.message)
                raise EngineDeadError(f"the engine failed to start: {msg.message}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
