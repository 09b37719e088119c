"""The load test (scripts/loadtest.py, `llmserve bench serve`) against the real server, started as
`python -m llmserve.cli serve` on a free loopback port; plus its metric definitions on hand-built
records and its behaviour when requests fail or the run hits --max-duration."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve.bench.client import RequestRecord
from llmserve.bench.report import parse_goodput, summarize
from llmserve.cli import main
from tests.server_harness import server_process

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tiny_model, tmp_path_factory) -> Iterator[str]:
    with server_process(tiny_model, tmp_path_factory.mktemp("server") / "server.log") as server:
        yield server.url


def loadtest(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "loadtest.py"), "--disable-tqdm", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_loadtest_against_the_live_server(server_url, tmp_path):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    p = loadtest("--base-url", server_url, "--num-prompts", "20", "--max-concurrency", "4", "--input-len", "16",
                 "--output-len", "8", "--ignore-eos", "--seed", "3", "--json", str(out), "--plot", str(png))
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    s, reqs = doc["summary"], doc["requests"]
    assert s["successes"] + s["failures"] == 20 == len(reqs)
    assert s["successes"] == 20, s["errors"]
    assert all(r["success"] and r["output_tokens"] == 8 and r["finish_reason"] == "length" for r in reqs)
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in reqs) == 160
    assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in reqs) > 20 * 16 - 1
    assert s["missing_usage"] == 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        # tokens that reach the client in one read have no gap between them, so on a busy
        # machine most inter-token latencies can be 0: only the largest must not be
        assert 0 <= s[key]["p50"] <= s[key]["p99"] <= s[key]["max"] and s[key]["max"] > 0, key
    assert s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["p50"] > 0
    assert s["e2el_ms"]["max"] >= s["ttft_ms"]["max"] and s["output_throughput"] > 0
    assert doc["config"]["model"]  # discovered from GET /v1/models
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "TTFT" in p.stdout and "successful requests: 20 / 20" in p.stdout


def test_chat_endpoint_and_max_duration_bound_the_run(server_url, tmp_path):
    out = tmp_path / "chat.json"
    t = time.monotonic()
    # 2 requests/s for 8 prompts needs ~3.5 s of arrivals; the run is cut at 1.5 s
    rc = main(["bench", "serve", "--base-url", server_url, "--endpoint", "/v1/chat/completions", "--num-prompts", "8",
               "--request-rate", "2", "--input-len", "8", "--output-len", "4", "--ignore-eos", "--max-duration", "1.5",
               "--num-warmups", "0", "--disable-tqdm", "--json", str(out)])
    assert time.monotonic() - t < 10
    s = json.loads(out.read_text())["summary"]
    assert rc == 1  # not every request succeeded
    assert s["successes"] + s["failures"] == 8
    assert 1 <= s["successes"] < 8 and s["total_output_tokens"] == 4 * s["successes"]
    assert any("max-duration" in e for e in s["errors"])


@pytest.mark.parametrize("endpoint", ["/v1/responses", "/v1/messages"])
def test_responses_and_messages_endpoints_are_timed_like_chat(server_url, tmp_path, endpoint):
    out = tmp_path / "run.json"
    rc = main(["bench", "serve", "--base-url", server_url, "--endpoint", endpoint, "--num-prompts", "4", "--max-concurrency", "2",
               "--input-len", "8", "--output-len", "6", "--ignore-eos", "--num-warmups", "0", "--disable-tqdm", "--json", str(out)])
    doc = json.loads(out.read_text())
    s, reqs = doc["summary"], doc["requests"]
    assert rc == 0 and s["successes"] == 4, s["errors"]
    assert all(r["output_tokens"] == 6 and 1 <= len(r["chunk_times_s"]) <= 6 and r["prompt_tokens"] > 8 for r in reqs)  # a token may hold back its text
    assert {r["finish_reason"] for r in reqs} == {"incomplete" if endpoint == "/v1/responses" else "max_tokens"}
    assert s["missing_usage"] == 0 and 0 < s["ttft_ms"]["p50"] <= s["e2el_ms"]["p50"]


# `llmserve bench serve`, with a library that logs one INFO line per request (as httpx does)
NOISY_BENCH = """
import logging, sys
from llmserve import cli
from llmserve.bench import serve
real = serve.run_bench
def noisy(args):
    logging.getLogger("httpx").info("HTTP Request: POST /v1/completions")
    return real(args)
serve.run_bench = noisy
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_bench_output_is_its_table_unless_verbose(server_url, verbose):
    args = ["bench", "serve", "--base-url", server_url, "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
            "--disable-tqdm", *(["--verbose"] if verbose else [])]
    p = subprocess.run([sys.executable, "-c", NOISY_BENCH, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "successful requests: 2 / 2" in p.stdout
    assert ("HTTP Request" in p.stderr) == verbose, p.stderr


def test_failures_are_counted_not_raised(tmp_path):
    out = tmp_path / "down.json"
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "3",
               "--input-len", "4", "--output-len", "2", "--timeout", "5", "--disable-tqdm", "--json", str(out)])
    s = json.loads(out.read_text())["summary"]
    assert rc == 1 and (s["successes"], s["failures"]) == (0, 3)
    assert s["ttft_ms"]["p50"] is None and "Cannot connect" in next(iter(s["errors"]))


def _rec(i: int, ttft: float, latency: float, n_out: int, ok: bool = True) -> RequestRecord:
    r = RequestRecord(i, n_out, start_s=0.0, status=200, ttft_s=ttft, latency_s=latency, output_tokens=n_out, done=ok,
                      finish_reason="length" if ok else None, prompt_tokens=10)
    r.itl_s = [(latency - ttft) / max(n_out - 1, 1)] * (n_out - 1)
    r.chunk_times_s = [ttft] * n_out
    if not ok:
        r.error = "HTTP 429: busy"
    return r


def test_metric_definitions_match_vllm_bench_serve():
    recs = [_rec(0, 0.1, 1.1, 11), _rec(1, 0.3, 0.3, 1), _rec(2, 0.2, 2.2, 5), _rec(3, 0.1, 0.2, 2, ok=False)]
    s = summarize(recs, duration_s=2.0, slos=parse_goodput(["ttft:250", "tpot:200"]))
    assert (s["successes"], s["failures"]) == (3, 1) and s["errors"] == {"HTTP 429: busy": 1}
    # TPOT = (e2el - ttft) / (output - 1), only for requests with more than one token: 100 ms and 500 ms
    assert s["tpot_ms"]["mean"] == pytest.approx(300.0) and s["tpot_ms"]["max"] == pytest.approx(500.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["total_output_tokens"] == 17 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(1.5) and s["output_throughput"] == pytest.approx(8.5)
    # good: #0 (ttft 100, tpot 100); #1 fails ttft 300 > 250; #2 fails tpot 500 > 200
    assert s["request_goodput"] == pytest.approx(0.5)
    with pytest.raises(Exception, match="KEY:MILLISECONDS"):
        parse_goodput(["latency:5"])


def test_datasets(tmp_path):
    from llmserve.bench.datasets import build_dataset

    rnd = build_dataset("random", 50, input_len=20, output_len=10, range_ratio=0.5, seed=1)
    assert len(rnd) == 50 and all(10 <= len(r.prompt.split()) <= 30 and 5 <= r.max_tokens <= 15 for r in rnd)
    assert len({r.prompt for r in rnd}) == 50 and rnd == build_dataset("random", 50, 20, 10, 0.5, seed=1)
    pre = build_dataset("prefix-repetition", 12, input_len=4, output_len=3, prefix_len=30, num_prefixes=3)
    heads = {" ".join(r.prompt.split()[:30]) for r in pre}
    assert len(heads) == 3 and len({r.prompt for r in pre}) == 12 and all(len(r.prompt.split()) == 34 for r in pre)
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a b"}\n\n{"prompt": "c", "max_tokens": 3}\n')
    js = build_dataset("jsonl", 5, input_len=0, output_len=7, path=str(path))
    assert [(r.prompt, r.max_tokens) for r in js] == [("a b", 7), ("c", 3), ("a b", 7), ("c", 3), ("a b", 7)]
    path.write_text('{"text": "x"}\n')
    with pytest.raises(Exception, match="p.jsonl:1"):
        build_dataset("jsonl", 1, 0, 1, path=str(path))
