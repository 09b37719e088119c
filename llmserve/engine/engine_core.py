"""EngineCore: the engine core in its own process (`python -m llmserve.engine.engine_core IN_FD
OUT_FD`), started by EngineCoreClient.launch; its loop steps an LLMEngine (engine/llm_engine.py).
It owns the scheduler, block manager, model runner and Redis KV tier, and never shares an
interpreter lock with the HTTP server.

Loop: take in every message that has arrived (waiting only when idle) -> one engine step ->
one StepOutputs with every request's new tokens. It exits on Shutdown, or when the server's
pipe closes (the server died): an orphaned core never outlives its server. After TRIM_AFTER_IDLE_S
without work it hands the heap's free pages back to the OS (the hot loop keeps them otherwise,
see engine/cpu_runtime.py).
"""

from __future__ import annotations

import itertools
import logging
import signal
import sys
import time
from collections import deque

from llmserve import errors
from llmserve.engine.messages import (
    AbortRequests,
    AddRequest,
    BadFrame,
    Configure,
    FrameReader,
    GetStats,
    Ready,
    Shutdown,
    StartupFailed,
    StatsReply,
    StepOutputs,
    ToCore,
    frame,
    read_available,
    write_all,
)
from llmserve.memory import release_free_memory
from llmserve.profiling import STAGES

logger = logging.getLogger("llmserve.engine")
IDLE_WAIT_S = 1.0  # an idle core re-checks its pipe this often (it wakes at once on a message)
TRIM_AFTER_IDLE_S = 10.0
STEP_RECORDS_KEPT = 1024


class EngineCore:
    def __init__(self, engine, in_fd: int, out_fd: int, reader: FrameReader, pending: list):
        self.engine = engine  # LLMEngine
        # only the last step's records are sent on: a long-running core keeps no history
        engine.step_records = deque(engine.step_records, maxlen=STEP_RECORDS_KEPT)
        self.in_fd, self.out_fd, self.reader = in_fd, out_fd, reader
        self.rejected: list[tuple[str, str]] = []
        self.pending = pending  # messages read along with the Configure frame

    def run(self) -> None:
        engine = self.engine
        last_work, trimmed = time.monotonic(), True
        while True:
            busy = engine.has_unfinished_requests()
            if busy:
                last_work, trimmed = time.monotonic(), False
            elif not trimmed and time.monotonic() - last_work >= TRIM_AFTER_IDLE_S:
                release_free_memory()
                trimmed = True
            got = read_available(self.in_fd, self.reader, 0.0 if busy or self.pending else IDLE_WAIT_S)
            if got is None:
                logger.info("the server has gone: engine core exits")
                return
            messages, self.pending = self.pending + got, []
            for msg in messages:
                if isinstance(msg, Shutdown):
                    return
                self._handle(msg)
            if not (engine.has_unfinished_requests() or self.rejected):
                continue
            steps_before = engine.num_steps
            outputs = engine.step()
            n_new = engine.num_steps - steps_before
            records = list(itertools.islice(reversed(engine.step_records), n_new))[::-1]
            durations = [r.duration_s for r in records]
            stages = [sum(getattr(r, f"{stage}_s") for r in records) for stage in STAGES]
            self._send(StepOutputs(outputs, engine.get_stats(), durations, self.rejected, stages))
            self.rejected = []

    def _handle(self, msg: object) -> None:
        if isinstance(msg, AddRequest):
            try:
                self.engine.add(msg.request)
            except errors.LLMServeError as e:  # a LoRA adapter that cannot be read (the rest the server checked)
                self.rejected.append((msg.request.request_id, e.message))
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.engine.abort_request(rid)
        elif isinstance(msg, GetStats):
            self._send(StatsReply(msg.call_id, self.engine.get_stats(memory=True)))
        elif isinstance(msg, BadFrame):  # a bug on the server side: refuse that request, carry on
            logger.error("engine core: unreadable message (%s)", msg.error)
            added = msg.added_request()
            if added is not None:
                self.rejected.append((added, f"the engine could not read the request: {msg.error}"))

    def _send(self, msg: object) -> None:
        write_all(self.out_fd, frame(msg))


def main(argv: list[str]) -> int:
    in_fd, out_fd = int(argv[0]), int(argv[1])
    # Ctrl-C in a terminal reaches the whole process group, and a service manager's SIGTERM may
    # reach every process of the service: the server drains, then stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    reader = FrameReader(ToCore)
    first = read_available(in_fd, reader, None)
    if not first or not isinstance(first[0], Configure):
        return 1
    configure: Configure = first[0]
    logging.basicConfig(level=configure.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        from llmserve.engine.llm_engine import LLMEngine

        engine = LLMEngine(configure.config)
    except errors.LLMServeError as e:
        write_all(out_fd, frame(StartupFailed(type(e).__name__, e.message)))
        return 2
    except Exception as e:
        logger.exception("engine start-up failed")
        write_all(out_fd, frame(StartupFailed("internal", f"{type(e).__name__}: {e}")))
        return 1
    write_all(out_fd, frame(Ready(engine.info)))
    try:
        EngineCore(engine, in_fd, out_fd, reader, first[1:]).run()
    except BrokenPipeError:
        logger.info("the server has gone: engine core exits")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
