"""The playground and dashboard in a real browser: Debian's chromium, driven headless by
Playwright (skipped, with the reason, when either is missing).

A prompt streams into the page token by token, ends with the text /v1/chat/completions gives for
the same seeded request, and shows its TTFT and one ITL point per token; Stop ends the stream and
the server aborts the request; with --api-key the page fails visibly without the key and works
with it; the dashboard moves while a load runs; the page weighs under 300 KB and fetches nothing
from anywhere but the server. Set LLMSERVE_SCREENSHOTS=DIR to save the README's screenshots."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_harness import live_server, wait_for

from llmserve.server.live import LiveStats, _observe, percentile_ms

pytestmark = pytest.mark.timeout(300)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = os.environ.get("LLMSERVE_SCREENSHOTS")
QUESTION = "Tell me about rivers."


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    if CHROMIUM is None:
        pytest.skip("no chromium binary (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    # bypass_csp: the test's own probes are evaluated scripts; the page's policy is checked below
    context = browser.new_context(viewport={"width": 1200, "height": 900}, bypass_csp=True)
    outside: list[str] = []

    def only_the_server(route):
        if route.request.url.startswith(server.url):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    context.route("**/*", only_the_server)
    p = context.new_page()
    p.outside = outside
    yield p
    context.close()


def fill(page, prompt: str, **fields: str) -> None:
    for name, value in fields.items():
        page.fill(f"#{name}", value)
    page.fill("#prompt", prompt)


def answer_done(page) -> None:
    page.wait_for_function("document.getElementById('tokens').textContent !== '–'", timeout=60_000)


def test_a_streamed_answer_with_its_latencies(server, page):
    page.goto(server.url + "/")
    page.evaluate("""() => {
        window.sizes = [];
        const out = document.getElementById('output');
        new MutationObserver(() => window.sizes.push(out.textContent.length))
            .observe(out, {childList: true, subtree: true, characterData: true});
    }""")
    fill(page, QUESTION, temperature="0.8", seed="7", **{"max-tokens": "48"})
    page.click("#send")
    answer_done(page)
    sizes = page.evaluate("window.sizes")
    growth = [b for a, b in zip([0, *sizes], sizes, strict=False) if b > a]
    assert len(growth) >= 3, sizes  # it grew step by step, not at once

    api = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": QUESTION}], "temperature": 0.8, "seed": 7, "max_tokens": 48, "top_p": 1})
    expected = api.json()["choices"][0]["message"]["content"]
    assert page.text_content("#output") == expected
    n = int(page.text_content("#tokens"))
    assert n == api.json()["usage"]["completion_tokens"]
    assert float(page.text_content("#ttft").split()[0]) > 0
    assert page.locator("#itl-chart circle.point").count() == n == page.locator("#output .tok").count()
    page.focus("#output .tok >> nth=2")
    assert "t_ms" in page.text_content("#token-info")
    assert page.text_content("#history").count("user:") == 1  # the turn went into the conversation
    if SHOTS:
        page.screenshot(path=str(Path(SHOTS) / "playground.png"), full_page=True)
    assert page.outside == []


def metric(url: str, name: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def test_stop_ends_the_stream_and_the_server_aborts_it(server, page):
    aborted = metric(server.url, "llmserve:request_aborted_total")

    def without_eos(route):  # a random model may end early; this answer must outlast the click
        route.continue_(post_data=json.dumps(json.loads(route.request.post_data) | {"ignore_eos": True}))

    page.route("**/generate", without_eos)
    page.goto(server.url + "/playground")
    fill(page, "Count to a thousand.", temperature="1", **{"max-tokens": "900"})
    # Stop is clicked inside the page on the 5th token: the tiny model streams ~1000 tokens a
    # second, so a click sent from the test process could arrive after the answer has ended.
    page.evaluate("""() => new MutationObserver((_, obs) => {
        if (document.querySelectorAll('#output .tok').length >= 5) { obs.disconnect(); document.getElementById('stop').click(); }
    }).observe(document.getElementById('output'), {childList: true, subtree: true})""")
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('#output .tok').length >= 5", timeout=60_000)
    page.wait_for_function("document.getElementById('send').disabled === false", timeout=10_000)
    stopped = page.locator("#output .tok").count()
    assert stopped < 900
    wait_for(lambda: metric(server.url, "llmserve:request_aborted_total") > aborted, 10, "the server did not abort it")
    wait_for(lambda: metric(server.url, "llmserve:num_requests_running") == 0, 10, "a request is still running")
    time.sleep(0.5)
    assert page.locator("#output .tok").count() == stopped  # it stopped growing
    assert "Stopped" in page.text_content("#token-info")


def test_dashboard_moves_under_load(server, page):
    stop = threading.Event()

    def load() -> None:
        deadline = time.monotonic() + 60
        with httpx.Client(base_url=server.url, timeout=60) as c:
            while not stop.is_set() and time.monotonic() < deadline:
                c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 32, "temperature": 1.0})

    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        page.goto(server.url + "/dashboard")
        assert page.is_visible("#dashboard")
        page.wait_for_function("parseFloat(document.getElementById('dash-tps').textContent) > 0", timeout=30_000)
        read = lambda: [page.text_content(f"#dash-{k}") for k in ("tps", "running", "kv", "ttft", "itl")]  # noqa: E731
        first = read()
        page.wait_for_timeout(2500)
        second = read()
        assert first != second and float(second[0]) > 0
        assert page.locator("#chart-tps polyline").count() == 1
        if SHOTS:
            page.screenshot(path=str(Path(SHOTS) / "dashboard.png"), full_page=True)
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def test_page_weight_and_no_outside_requests(server, page):
    sizes: dict[str, int] = {}
    page.on("response", lambda r: sizes.__setitem__(r.url, len(r.body())))
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model').textContent !== ''", timeout=10_000)
    assert {u.removeprefix(server.url) for u in sizes} >= {"/", "/ui/app.js", "/ui/app.css", "/v1/models"}
    assert sum(sizes.values()) < 300_000
    assert page.outside == [] and all(u.startswith(server.url) for u in sizes)
    for bad in ("nan", "inf", "soon"):
        r = httpx.get(server.url + f"/stats/live?since={bad}", timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "since"
    policy = httpx.get(server.url + "/", timeout=10).headers["content-security-policy"]
    assert "default-src 'self'" in policy and "connect-src 'self'" in policy


def test_api_key_is_asked_for_and_sent(tiny_model, browser):
    with live_server(tiny_model, api_key="sekret") as s:
        assert httpx.get(s.url + "/", timeout=10).status_code == 200  # the page itself needs no key
        assert httpx.get(s.url + "/stats/live", timeout=10).status_code == 401
        context = browser.new_context(bypass_csp=True)
        page = context.new_page()
        page.goto(s.url + "/")
        fill(page, QUESTION, **{"max-tokens": "8"})
        page.click("#send")
        page.wait_for_selector("#error:not([hidden])", timeout=10_000)
        assert "401" in page.text_content("#error") and page.text_content("#output") == ""
        page.fill("#api-key", "sekret")
        page.click("#send")
        answer_done(page)
        assert page.is_hidden("#error") and page.text_content("#output")
        assert "sekret" not in page.content() and "sekret" not in page.url
        page.click("#copy-curl")
        assert "sekret" not in page.text_content("#snippet") and "$LLMSERVE_API_KEY" in page.text_content("#snippet")
        context.close()


def test_no_playground_flag(tiny_model):
    with live_server(tiny_model, playground=False) as s:
        assert httpx.get(s.url + "/", timeout=10).status_code == 404
        assert httpx.get(s.url + "/ui/app.js", timeout=10).status_code == 404
        assert "/" not in httpx.get(s.url + "/openapi.json", timeout=10).json()["paths"]


def test_live_stats_percentiles_and_idle_seconds():
    from llmserve.engine.outputs import EngineStats

    assert percentile_ms([0] * 64, 0.5) is None
    hist = [0] * 64
    for seconds in [0.010] * 98 + [0.5, 2.0]:
        _observe(hist, seconds)
    assert 9 <= percentile_ms(hist, 0.5) <= 11 and 450 <= percentile_ms(hist, 0.99) <= 560  # within a bin (24%)
    now = [1000.2]
    stats = EngineStats(2, 1, 100, 50, 50, 0.5, 10, 4, 0, 1)
    live = LiveStats(lambda: stats, lambda: type("T", (), {"hits": 0, "misses": 0})(), clock=lambda: now[0])
    assert live.points(0, stats) == []  # nothing before the first second it saw
    now[0] = 1003.5  # seconds 1001 and 1002 saw nothing: they keep the gauges, with zero tokens
    points = live.points(0, stats)
    assert [p["t"] for p in points] == [1000, 1001, 1002]
    assert all(p["running"] == 2 and p["tok_s"] == 0 for p in points)
    assert live.points(1002, stats) == []


def test_a_model_picker_when_lora_adapters_are_served(tiny_model, browser, tmp_path):
    """With adapters, the page offers the base and each adapter, and sends the chosen one."""
    from peft import LoraConfig, get_peft_model
    from test_lora import ADAPTERS
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    get_peft_model(base, LoraConfig(init_lora_weights=False, **ADAPTERS["attn"])).save_pretrained(str(tmp_path / "attn"))
    with live_server(tiny_model, enable_lora=True, lora_modules=[f"sql={tmp_path / 'attn'}"]) as s:
        context = browser.new_context(bypass_csp=True)
        page = context.new_page()
        page.goto(s.url + "/")
        page.wait_for_selector("#model-label:not([hidden])", timeout=10_000)
        assert page.eval_on_selector_all("#model-picker option", "os => os.map(o => o.value)") == [s.model, "sql"]
        page.select_option("#model-picker", "sql")
        fill(page, QUESTION, **{"max-tokens": "4"})
        with page.expect_request(lambda r: r.url.endswith("/generate")) as sent:
            page.click("#send")
        assert json.loads(sent.value.post_data)["model"] == "sql"
        answer_done(page)
        assert page.is_hidden("#error")
        page.click("#copy-curl")
        assert '"model":"sql"' in page.text_content("#snippet")
        context.close()
    with live_server(tiny_model) as plain:  # no adapters: no picker
        context = browser.new_context(bypass_csp=True)
        page = context.new_page()
        page.goto(plain.url + "/")
        page.wait_for_function("document.getElementById('model').textContent !== ''", timeout=10_000)
        assert page.is_hidden("#model-label")
        context.close()
