"""AsyncEngine: the asyncio front end. The engine loop runs in its own thread.

asyncio side                          engine thread
generate() --inbox(add/abort)-->      drain inbox -> step() -> outputs
   await queue   <--call_soon_threadsafe(per-request asyncio.Queue)--

Invariants: every accepted request ends with exactly one finished output (stop, length or
abort) or an exception; a caller that stops iterating (client gone) aborts its request, and the
engine frees its blocks at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from llmserve.engine.engine_core import LLMEngine
from llmserve.engine.outputs import EngineStats, RequestOutput
from llmserve.engine.request import Request
from llmserve.errors import EngineDeadError, EngineOverloadedError

logger = logging.getLogger("llmserve.engine")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256, max_waiting_tokens: int | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.max_waiting_tokens = max_waiting_tokens
        self.inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.streams: dict[str, _Stream] = {}
        self.lock = threading.Lock()  # guards streams and the waiting counters
        self.num_submitted_waiting = 0  # accepted, not yet seen by the engine thread
        self.tokens_submitted_waiting = 0
        self.stats: EngineStats = engine.get_stats()
        self.error: BaseException | None = None
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="llmserve-engine", daemon=True)
        self.step_listeners: list = []  # callables(outputs, engine) run on the engine thread

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def num_waiting(self) -> int:
        return self.stats.num_waiting + self.num_submitted_waiting

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Submit a validated request (see LLMEngine.make_request); yields deltas until finished."""
        stream = self._submit(req)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self.lock:
                self.streams.pop(req.request_id, None)
            if not finished:
                self.abort(req.request_id)

    def _submit(self, req: Request) -> _Stream:
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        if self.stopped:
            raise EngineDeadError("the server is shutting down")
        with self.lock:
            waiting_tokens = self.tokens_submitted_waiting  # an estimate: the engine's own queue adds to it
            if self.num_waiting() >= self.max_waiting or (
                self.max_waiting_tokens is not None and waiting_tokens + req.num_prompt_tokens > self.max_waiting_tokens
            ):
                raise EngineOverloadedError(f"the server is overloaded ({self.num_waiting()} requests waiting); retry later")
            stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
            self.streams[req.request_id] = stream
            self.num_submitted_waiting += 1
            self.tokens_submitted_waiting += req.num_prompt_tokens
        self.inbox.put(("add", req))
        self.wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))
        self.wake.set()

    def abort_all(self) -> None:
        with self.lock:
            ids = list(self.streams)
        for rid in ids:
            self.abort(rid)

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not (self.stopped and not self.engine.has_unfinished_requests() and self.inbox.empty()):
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self.wake.wait(0.05)
                    self.wake.clear()
                    continue
                outputs = self.engine.step()
                self.stats = self.engine.get_stats()
                for listener in self.step_listeners:
                    listener(outputs, self.engine)
                self._deliver(outputs)
        except BaseException as e:  # the engine is dead: tell every waiting caller
            logger.exception("engine thread died")
            self.error = e
            self._fail_all(EngineDeadError(f"the engine failed: {e}"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                req: Request = item  # type: ignore[assignment]
                with self.lock:
                    self.num_submitted_waiting -= 1
                    self.tokens_submitted_waiting -= req.num_prompt_tokens
                    live = req.request_id in self.streams
                if live:  # its caller may have gone before the engine saw it
                    self.engine.add(req)
            else:
                self.engine.abort_request(item)  # type: ignore[arg-type]
        self.stats = self.engine.get_stats()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self.lock:
            for o in outputs:
                s = self.streams.get(o.request_id)
                if s is not None:
                    by_loop.setdefault(s.loop, []).append((s.queue, o))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, error: BaseException) -> None:
        with self.lock:
            streams = list(self.streams.values())
        for s in streams:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, error)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, o in items:
        q.put_nowait(o)
