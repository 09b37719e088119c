// llmserve playground and dashboard: plain JS, no build step, talks only to this server.
// The API key lives in this page's memory only (never in the page's markup, a URL or storage).
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const state = { history: [], controller: null, lastT: 0, points: [], polling: null, polling_now: false, model: null };

// ---- requests ---------------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function failure(res) {
  let message = res.statusText;
  try { message = (await res.json()).error.message; } catch (e) { /* not JSON */ }
  return `${res.status}: ${message}`;
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

function params() {
  const p = { temperature: Number($("temperature").value), top_p: Number($("top-p").value),
              max_tokens: Number($("max-tokens").value) };
  if ($("seed").value !== "") p.seed = Number($("seed").value);
  const stop = $("stop-strings").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) p.stop = stop;
  return p;
}

function messages(prompt) {
  const out = [];
  if ($("system").value.trim()) out.push({ role: "system", content: $("system").value });
  return out.concat(state.history, [{ role: "user", content: prompt }]);
}

// What the page sends (/generate, token events with t_ms) and the same request through the
// OpenAI API, for the copy buttons.
function requests(prompt) {
  const p = { ...(state.model ? { model: state.model } : {}), ...params() };
  if ($("mode").value === "chat") {
    const m = messages(prompt);
    return { native: { messages: m, ...p, stream: true }, path: "/v1/chat/completions", openai: { messages: m, ...p } };
  }
  return { native: { prompt, ...p, stream: true }, path: "/v1/completions", openai: { prompt, ...p } };
}

// ---- the answer, token by token ---------------------------------------------------------------

function shade(itl) {
  // 5 ms (green) .. 500 ms (red), on a log scale
  const x = Math.min(Math.max(Math.log10(Math.max(itl, 5) / 5) / 2, 0), 1);
  return `hsla(${Math.round(130 - 130 * x)}, 75%, 70%, 0.55)`;
}

function addToken(ev, prevMs) {
  const itl = ev.index === 0 ? ev.t_ms : ev.t_ms - prevMs;
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = ev.token.text;
  span.tabIndex = 0;
  span.dataset.index = ev.index;
  span.dataset.tMs = ev.t_ms;
  span.dataset.itlMs = itl.toFixed(1);
  span.title = `token ${ev.index}: t_ms ${ev.t_ms}, ${ev.index === 0 ? "TTFT" : "ITL"} ${itl.toFixed(1)} ms`;
  span.style.background = shade(itl);
  const info = () => { $("token-info").textContent = span.title; };
  span.addEventListener("mouseenter", info);
  span.addEventListener("focus", info);
  $("output").appendChild(span);
  return itl;
}

function finish(final, itls, cache) {
  const t = final.timings || {};
  const n = final.token_ids ? final.token_ids.length : itls.length;
  $("ttft").textContent = t.ttft_ms != null ? `${t.ttft_ms.toFixed(1)} ms` : "–";
  $("tpot").textContent = t.tpot_ms != null ? `${t.tpot_ms.toFixed(1)} ms` : "–";
  $("tokens").textContent = String(n);
  const span = t.e2e_ms && t.ttft_ms != null ? (t.e2e_ms - t.ttft_ms) / 1000 : 0;
  $("tps").textContent = n > 1 && span > 0 ? ((n - 1) / span).toFixed(1) : "–";
  $("cache").textContent = cache || "–";
}

async function* sseEvents(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("");
      if (data) yield JSON.parse(data);
    }
  }
}

function resetAnswer() {
  $("output").textContent = "";
  for (const id of ["ttft", "tpot", "tokens", "tps", "cache"]) $(id).textContent = "–";
  $("token-info").textContent = "Hover or focus a token to see when it arrived.";
  showError("");
  drawChart($("itl-chart"), [{ values: [], color: "#2563eb", dots: true }]);
}

async function send() {
  const prompt = $("prompt").value;
  if (!prompt.trim()) { showError("Write a prompt first."); return; }
  resetAnswer();
  const req = requests(prompt);
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const itls = [];
  let prevMs = 0, text = "", final = null;
  try {
    const res = await fetch("/generate", { method: "POST", headers: headers(), body: JSON.stringify(req.native),
                                           signal: state.controller.signal });
    if (!res.ok) { showError(await failure(res)); return; }
    $("ttft").textContent = "…";
    for await (const ev of sseEvents(res)) {
      if (ev.error) { showError(`error: ${ev.error.message}`); break; }
      if (ev.token) {
        itls.push(addToken(ev, prevMs));
        prevMs = ev.t_ms;
        text += ev.token.text;
        if (ev.index === 0) $("ttft").textContent = `${ev.t_ms.toFixed(1)} ms`;
        drawChart($("itl-chart"), [{ values: itls, color: "#2563eb", dots: true }]);
      } else if (ev.finish_reason) {
        final = ev;
        finish(ev, itls, res.headers.get("x-llmserve-cache"));
      }
    }
  } catch (e) {
    if (e.name === "AbortError") $("token-info").textContent = `Stopped after ${itls.length} tokens.`;
    else showError(String(e));
  } finally {
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
  if ($("mode").value === "chat" && (final || text)) {
    state.history.push({ role: "user", content: prompt }, { role: "assistant", content: final ? final.generated_text : text });
    renderHistory();
    $("prompt").value = "";
  }
}

function renderHistory() {
  const box = $("history");
  box.textContent = "";
  for (const m of state.history) {
    const div = document.createElement("div");
    div.className = `turn ${m.role}`;
    div.textContent = `${m.role}: ${m.content}`;
    box.appendChild(div);
  }
}

// ---- copy as curl / Python --------------------------------------------------------------------

function snippet(kind) {
  const req = requests($("prompt").value || "Hello!");
  const body = req.openai;
  const auth = $("api-key").value.trim() ? "$LLMSERVE_API_KEY" : null;  // never the key itself
  if (kind === "curl") {
    const a = auth ? ` \\\n  -H "Authorization: Bearer ${auth}"` : "";
    return `curl ${location.origin}${req.path} \\\n  -H "Content-Type: application/json"${a} \\\n  -d '${JSON.stringify(body).replace(/'/g, "'\\''")}'`;
  }
  const call = req.path.includes("chat") ? "chat.completions" : "completions";
  const args = Object.entries(body).map(([k, v]) => `    ${k}=${JSON.stringify(v)},`).join("\n");
  const key = auth ? 'os.environ["LLMSERVE_API_KEY"]' : '"unused"';
  return `import os\nfrom openai import OpenAI\n\nclient = OpenAI(base_url="${location.origin}/v1", api_key=${key})\n` +
         `response = client.${call}.create(\n${args}\n)\nprint(response)`
           .replace(/=true,/g, "=True,").replace(/=false,/g, "=False,").replace(/=null,/g, "=None,");
}

async function copy(kind) {
  const text = snippet(kind);
  $("snippet").textContent = text;
  $("snippet").hidden = false;
  try { await navigator.clipboard.writeText(text); } catch (e) { /* shown below instead */ }
}

// ---- charts (SVG polylines, one per series) ---------------------------------------------------

function drawChart(svg, series, maxHint) {
  const W = 600, H = 140, pad = 14;
  svg.textContent = "";
  const all = series.flatMap((s) => s.values.filter((v) => v != null));
  const max = Math.max(maxHint || 0, ...all, 1e-9);
  const n = Math.max(...series.map((s) => s.values.length), 2);
  const x = (i) => pad + (i * (W - 2 * pad)) / (n - 1);
  const y = (v) => H - pad - (v / max) * (H - 2 * pad);
  for (const s of series) {
    const pts = s.values.map((v, i) => (v == null ? null : `${x(i).toFixed(1)},${y(v).toFixed(1)}`)).filter(Boolean);
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", s.color);
    line.setAttribute("stroke-width", "1.5");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.appendChild(line);
    if (s.dots) {
      s.values.forEach((v, i) => {
        const c = document.createElementNS(SVG, "circle");
        c.setAttribute("class", "point");
        c.setAttribute("cx", x(i).toFixed(1));
        c.setAttribute("cy", y(v).toFixed(1));
        c.setAttribute("r", "2");
        c.setAttribute("fill", s.color);
        svg.appendChild(c);
      });
    }
  }
  const label = svg.parentNode.querySelector(".max");
  if (label) label.textContent = all.length ? `(top: ${max >= 100 ? max.toFixed(0) : max.toPrecision(3)})` : "";
}

// ---- dashboard --------------------------------------------------------------------------------

const fmt = (v, unit = "") => (v == null ? "–" : `${Number.isInteger(v) ? v : v.toFixed(1)}${unit}`);
const pct = (v) => (v == null ? "–" : `${(v * 100).toFixed(0)}%`);

async function poll() {
  if (state.polling_now) return;  // one request at a time: a slow answer must not be read twice
  state.polling_now = true;
  try { await pollOnce(); } finally { state.polling_now = false; }
}

async function pollOnce() {
  const res = await fetch(`/stats/live?since=${state.lastT}`, { headers: headers() }).catch(() => null);
  if (!res || !res.ok) { if (res) showError(await failure(res)); return; }
  showError("");
  const data = await res.json();
  state.points = state.points.concat(data.points).slice(-300);
  if (data.points.length) state.lastT = data.points[data.points.length - 1].t;
  renderDashboard(data.stages);
}

function recent(key, span = 5) {
  // the latest non-empty value over the last `span` seconds (percentiles are per second)
  for (let i = state.points.length - 1; i >= Math.max(0, state.points.length - span); i--) {
    if (state.points[i][key] != null) return state.points[i][key];
  }
  return null;
}

function renderDashboard(stages) {
  const P = state.points;
  if (!P.length) return;
  const last = P[P.length - 1];
  const col = (k) => P.map((p) => p[k]);
  const tps5 = P.slice(-5).reduce((a, p) => a + p.tok_s, 0) / Math.min(5, P.length);
  $("dash-running").textContent = fmt(last.running);
  $("dash-waiting").textContent = fmt(last.waiting);
  $("dash-kv").textContent = pct(last.kv_usage);
  $("dash-tps").textContent = tps5.toFixed(1);
  $("dash-ttft").textContent = `${fmt(recent("ttft_p50_ms"))} / ${fmt(recent("ttft_p99_ms"), " ms")}`;
  $("dash-itl").textContent = `${fmt(recent("itl_p50_ms"))} / ${fmt(recent("itl_p99_ms"), " ms")}`;
  $("dash-prefix").textContent = pct(recent("prefix_hit_rate", 30));
  $("dash-response").textContent = pct(recent("response_cache_hit_rate", 30));
  drawChart($("chart-requests"), [{ values: col("running"), color: "#2563eb" }, { values: col("waiting"), color: "#f79009" }]);
  drawChart($("chart-kv"), [{ values: P.map((p) => p.kv_usage * 100), color: "#7a5af8" }], 100);
  drawChart($("chart-tps"), [{ values: col("tok_s"), color: "#12b76a" }]);
  drawChart($("chart-ttft"), [{ values: col("ttft_p50_ms"), color: "#2563eb" }, { values: col("ttft_p99_ms"), color: "#f04438" }]);
  drawChart($("chart-itl"), [{ values: col("itl_p50_ms"), color: "#2563eb" }, { values: col("itl_p99_ms"), color: "#f04438" }]);
  drawChart($("chart-cache"), [{ values: P.map((p) => (p.prefix_hit_rate == null ? null : p.prefix_hit_rate * 100)), color: "#2563eb" },
                               { values: P.map((p) => (p.response_cache_hit_rate == null ? null : p.response_cache_hit_rate * 100)), color: "#12b76a" }], 100);
  const stage = (s) => P.map((p) => (p.steps ? p.step_ms[s] : null));
  const rest = P.map((p) => (p.steps ? stages.filter((s) => !["schedule", "forward", "sample"].includes(s))
    .reduce((a, s) => a + p.step_ms[s], 0) : null));
  drawChart($("chart-steps"), [{ values: stage("schedule"), color: "#f79009" }, { values: stage("forward"), color: "#2563eb" },
                               { values: stage("sample"), color: "#12b76a" }, { values: rest, color: "#667085" }]);
}

// ---- tabs and start-up ------------------------------------------------------------------------

function show(tab) {
  for (const name of ["playground", "dashboard"]) {
    $(name).hidden = name !== tab;
    $(`tab-${name}`).setAttribute("aria-selected", String(name === tab));
  }
  history.replaceState(null, "", tab === "dashboard" ? "/dashboard" : "/playground");
  if (tab === "dashboard" && !state.polling) { poll(); state.polling = setInterval(poll, 1000); }
  if (tab !== "dashboard" && state.polling) { clearInterval(state.polling); state.polling = null; }
}

async function loadModel() {
  const res = await fetch("/v1/models", { headers: headers() }).catch(() => null);
  if (res && res.ok) {
    const data = await res.json();
    const base = data.data[0].id;
    // the served model and its LoRA adapters (whose parent is the base); a picker when there are adapters
    const models = data.data.filter((m) => m.id === base || m.parent === base).map((m) => m.id);
    const picker = $("model-picker");
    picker.replaceChildren(...models.map((id) => Object.assign(document.createElement("option"), { value: id, textContent: id })));
    $("model-label").hidden = models.length < 2;
    state.model = models.includes(state.model) ? state.model : base;
    picker.value = state.model;
    $("model").textContent = base;
  }
}

$("params").addEventListener("submit", (e) => e.preventDefault());
$("send").addEventListener("click", send);
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => { state.history = []; renderHistory(); resetAnswer(); });
$("copy-curl").addEventListener("click", () => copy("curl"));
$("copy-python").addEventListener("click", () => copy("python"));
$("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && e.ctrlKey) send(); });
$("mode").addEventListener("change", () => { $("system-label").hidden = $("mode").value !== "chat"; });
$("api-key").addEventListener("change", loadModel);
$("model-picker").addEventListener("change", () => { state.model = $("model-picker").value; });
$("tab-playground").addEventListener("click", () => show("playground"));
$("tab-dashboard").addEventListener("click", () => show("dashboard"));
show(location.pathname.startsWith("/dashboard") ? "dashboard" : "playground");
resetAnswer();
loadModel();
