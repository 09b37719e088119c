"""RayEngineClient (the engine door under --ray) against a scripted stand-in for the Engine
deployment's handle: the door's invariants without a cluster. Every accepted request's sink gets
outputs until one is finished, or one exception; a request that failed before its first output
is sent again; abort frees everything; abort_all ends each stream with an "abort" output."""

from __future__ import annotations

import asyncio

import pytest

from llmserve.config import EngineConfig
from llmserve.engine.admission import EngineInfo
from llmserve.engine.outputs import RequestOutput
from llmserve.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from llmserve.ray_serve.client import RayEngineClient
from llmserve.sampling import SamplingParams

INFO = EngineInfo("m", "/m", "fp", 100, 64, 16, 8, (0,), 1)


def output(rid: str, n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [n], str(n), [], finished, "length" if finished else None, None, 3, n, 0, 0.0)


class Stream:
    """What handle.generate.remote(req) returns: async-iterable, cancellable."""

    def __init__(self, script):
        self.script, self.cancelled = script, False

    def __aiter__(self):
        return self.script.__aiter__()

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """Each call to generate.remote plays the next script (an async generator function of the request)."""

    def __init__(self, *scripts):
        self.scripts, self.streams = list(scripts), []
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, req):
        self.streams.append(Stream(self.scripts.pop(0)(req)))
        return self.streams[-1]


def tokens(n: int, *, fail_after: int | None = None, wait: asyncio.Event | None = None):
    async def script(req):
        for i in range(1, n + 1):
            if wait is not None:
                await wait.wait()
            if fail_after is not None and i > fail_after:
                raise RuntimeError("the replica's actor died")
            yield [output(req.request_id, i, finished=i == n)]
    return script


def failing(error: Exception):
    async def script(req):
        raise error
        yield  # an async generator

    return script


async def run(client: RayEngineClient, rid: str = "a") -> list:
    got: list = []
    done = asyncio.Event()

    def sink(item) -> None:
        got.append(item)
        if isinstance(item, BaseException) or item.finished:
            done.set()

    client.add_request(client.make_request(rid, [1, 2, 3], SamplingParams(max_tokens=5), 0.0), sink)
    await asyncio.wait_for(done.wait(), 5)
    await asyncio.sleep(0)  # the task's done callback
    return got


def client_over(handle: Handle, **limits) -> RayEngineClient:
    return RayEngineClient(handle, EngineConfig(), INFO, "test", **limits)


def test_outputs_reach_the_sink_until_finished():
    client = client_over(Handle(tokens(3)))
    steps = []
    client.add_step_listener(steps.append)
    got = asyncio.run(run(client))
    assert [o.num_output_tokens for o in got] == [1, 2, 3] and got[-1].finished
    assert client.num_in_flight() == 0 and client.requests.num_waiting == 0 and client._requests == {}
    assert sum(len(s.outputs) for s in steps) == 3  # metrics and the dashboard see every output


def test_a_failure_before_the_first_output_is_sent_again():
    handle = Handle(failing(RuntimeError("actor died")), tokens(2))
    got = asyncio.run(run(client_over(handle)))
    assert [o.num_output_tokens for o in got] == [1, 2]
    assert handle.streams[0].cancelled and len(handle.streams) == 2


def test_a_failure_mid_stream_ends_it_with_an_error():
    handle = Handle(tokens(5, fail_after=2), tokens(5))
    got = asyncio.run(run(client_over(handle)))
    assert [o.num_output_tokens for o in got[:-1]] == [1, 2]
    assert isinstance(got[-1], EngineDeadError) and got[-1].code == "replica_failed"
    assert len(handle.streams) == 1  # tokens were sent: never run twice


def test_a_refused_request_is_not_retried():
    handle = Handle(failing(InvalidRequestError("bad", "prompt")), tokens(1))
    got = asyncio.run(run(client_over(handle)))
    assert len(got) == 1 and isinstance(got[0], InvalidRequestError) and len(handle.streams) == 1


def test_abort_before_the_stream_starts_leaves_nothing_behind():
    async def main(client: RayEngineClient) -> None:
        client.add_request(client.make_request("a", [1], SamplingParams(max_tokens=5), 0.0), lambda _: None)
        assert client.requests.num_waiting == 1
        client.abort_request("a")  # in the same step: the task never runs
        await asyncio.sleep(0.01)
        assert client._requests == {} and client.num_in_flight() == 0 and client.requests.num_waiting == 0

    asyncio.run(main(client_over(Handle(tokens(5)))))


def test_abort_all_ends_each_stream_with_an_abort_output():
    async def main() -> None:
        gate = asyncio.Event()
        handle = Handle(tokens(5, wait=gate))
        client = client_over(handle)
        got: list = []
        client.add_request(client.make_request("a", [1, 2, 3], SamplingParams(max_tokens=5), 0.0), got.append)
        await asyncio.sleep(0.01)
        client.abort_all()
        await asyncio.sleep(0.01)
        assert [(o.finished, o.finish_reason, o.num_prompt_tokens) for o in got] == [(True, "abort", 3)]
        assert handle.streams[0].cancelled and client._requests == {}

    asyncio.run(main())


def test_too_many_waiting_is_a_429():
    async def main() -> None:
        gate = asyncio.Event()
        client = client_over(Handle(tokens(1, wait=gate), tokens(1, wait=gate)), max_waiting=2)
        for rid in ("a", "b"):
            client.add_request(client.make_request(rid, [1], SamplingParams(), 0.0), lambda _: None)
        with pytest.raises(EngineOverloadedError):
            client.add_request(client.make_request("c", [1], SamplingParams(), 0.0), lambda _: None)
        gate.set()
        await asyncio.sleep(0.01)
        assert client.requests.num_waiting == 0

    asyncio.run(main())
