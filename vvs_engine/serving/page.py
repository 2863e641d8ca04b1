"""``GET /``: one self-contained page (no build step, no external assets) that calls the server's
own API: pick a class or type a prompt, set n, seed and guidance, and watch the images' progress
stream in (each image filling in top to bottom from three partial images), then the images with their
TPF and latency.

It is served with a Content-Security-Policy that allows exactly its own inline script and style (by
their SHA-256), its own API and ``data:`` images, and no framing (``PAGE_HEADERS``)."""
import base64
import hashlib
import re

PAGE_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>vvs-engine</title>
<style>
 [hidden] { display: none !important; }
 body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
 h1 { font-size: 1.3em; margin: 0 0 .2em; }
 #info { color: #666; margin-bottom: 1em; }
 form { display: flex; flex-wrap: wrap; gap: .8em 1.2em; align-items: end; margin-bottom: 1em; }
 label { display: flex; flex-direction: column; font-size: .85em; color: #444; }
 input, select { font: inherit; padding: .2em .3em; }
 input[type=number] { width: 6em; }
 button { font: inherit; padding: .35em 1.2em; }
 #status { margin: .5em 0 1em; min-height: 1.4em; }
 #images { display: flex; flex-wrap: wrap; gap: 12px; }
 .cell { width: 160px; text-align: center; font-size: .8em; color: #555; }
 .cell img, .cell .blank { width: 160px; height: 160px; image-rendering: pixelated; background: #e4e4e4;
   display: block; border-radius: 4px; }
 .bar { height: 6px; background: #ddd; border-radius: 3px; margin: 4px 0; overflow: hidden; }
 .bar div { height: 100%; width: 0; background: #3a7; transition: width .2s; }
 .error { color: #b00; }
</style>
</head>
<body>
<h1>vvs-engine</h1>
<div id="info">loading model information...</div>
<form id="form">
 <label id="class-box">class <select id="class"></select></label>
 <label id="prompt-box" hidden>prompt <input id="prompt" size="40" value="a photo of a cat"></label>
 <label>images (n) <input id="n" type="number" min="1" value="4"></label>
 <label>seed <input id="seed" type="number" min="0" value="0"></label>
 <label>guidance (cfg) <input id="cfg" type="number" min="0" step="0.5"></label>
 <label>API key (if the server needs one) <input id="key" type="password" size="12" autocomplete="off"></label>
 <button id="go" type="submit">Generate</button>
</form>
<div id="status"></div>
<div id="images"></div>
<script>
"use strict";
let model = null;
const $ = (id) => document.getElementById(id);

function headers() {
  const out = { "Content-Type": "application/json" };
  if ($("key").value) out["Authorization"] = "Bearer " + $("key").value;
  return out;
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  const body = await response.json();
  if (!response.ok) throw new Error(response.status + ": " + body.error.message + " (enter the API key)");
  model = body.data[0];
  $("info").textContent = model.id + " | method " + model.method + " | " + model.size + " px | " +
    model.rows + " rows in flight | at most " + model.max_n + " images a request";
  $("n").max = model.max_n;
  $("cfg").value = model.defaults.cfg_scale;
  if (model.conditioning === "c2i") {
    const names = model.class_names || [];
    for (let i = 0; i < model.num_classes; i++) {
      const option = document.createElement("option");
      option.value = i;
      option.textContent = i + (names[i] ? " " + names[i] : "");
      $("class").appendChild(option);
    }
  } else {
    $("class-box").hidden = true;
    $("prompt-box").hidden = false;
  }
}

function cells(n) {
  const box = $("images");
  box.innerHTML = "";
  const out = [];
  for (let i = 0; i < n; i++) {
    const cell = document.createElement("div");
    cell.className = "cell";
    cell.innerHTML = '<div class="blank"></div><div class="bar"><div></div></div><span>waiting</span>';
    box.appendChild(cell);
    out.push(cell);
  }
  return out;
}

function parseEvents(buffer, onEvent) {
  let cut;
  while ((cut = buffer.indexOf("\\n\\n")) >= 0) {
    const block = buffer.slice(0, cut);
    buffer = buffer.slice(cut + 2);
    let name = "message", data = "";
    for (const line of block.split("\\n")) {
      if (line.startsWith("event: ")) name = line.slice(7);
      else if (line.startsWith("data: ")) data += line.slice(6);
    }
    if (data) onEvent(name, JSON.parse(data));
  }
  return buffer;
}

async function generate(event) {
  event.preventDefault();
  const n = parseInt($("n").value, 10);
  const body = { n: n, seed: parseInt($("seed").value, 10), stream: true, progress: true, partial_images: 3,
                 response_format: "b64_json" };
  const cfg = parseFloat($("cfg").value);
  if (!isNaN(cfg)) body.cfg_scale = cfg;
  if (model.conditioning === "c2i") body.class_label = parseInt($("class").value, 10);
  else body.prompt = $("prompt").value;
  if (model === null) await loadModel();
  const grid = cells(n);
  const started = performance.now();
  $("go").disabled = true;
  $("status").className = "";
  $("status").textContent = "submitted";
  try {
    const response = await fetch("/v1/images/generations", {
      method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!response.ok) {
      const error = await response.json();
      throw new Error(response.status + ": " + error.error.message);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer = parseEvents(buffer + decoder.decode(value, { stream: true }), (name, data) => {
        if (name === "image_generation.started") {
          $("status").textContent = "seed " + data.seed + ": decoding";
        } else if (name === "image_generation.progress") {
          const cell = grid[data.image_index];
          cell.querySelector(".bar div").style.width = (100 * data.committed / data.total) + "%";
          cell.querySelector("span").textContent = data.committed + " / " + data.total + " tokens";
        } else if (name === "image_generation.partial_image") {  // the image fills in top to bottom
          const cell = grid[data.image_index];
          const img = document.createElement("img");
          img.className = "partial";
          img.alt = "image " + data.image_index + ", partial " + data.partial_image_index;
          img.src = "data:image/png;base64," + data.b64_json;
          cell.replaceChild(img, cell.firstChild);
        } else if (name === "image_generation.completed") {
          const cell = grid[data.image_index];
          const img = document.createElement("img");
          img.className = "result";
          img.alt = "image " + data.image_index;
          img.src = "data:image/png;base64," + data.b64_json;
          cell.replaceChild(img, cell.firstChild);
          cell.querySelector(".bar div").style.width = "100%";
          cell.querySelector("span").textContent = "TPF " + (model.tokens_per_image / data.target_forward_passes).toFixed(2);
          if (data.summary) {  // the last image carries the request's summary
            const s = data.summary, seconds = (performance.now() - started) / 1000;
            $("status").textContent = "done: seed " + s.seed + ", " + s.usage.images + " images, TPF " +
              s.usage.tpf.toFixed(2) + ", latency " + seconds.toFixed(1) + " s (queue " +
              (s.timings.queue_s || 0).toFixed(2) + " s)";
            $("status").dataset.done = "1";
          }
        } else if (name === "error") {
          throw new Error(data.error.message);
        }
      });
    }
  } catch (error) {
    $("status").className = "error";
    $("status").textContent = "error: " + error.message;
  } finally {
    $("go").disabled = false;
  }
}

$("form").addEventListener("submit", generate);
loadModel().then(() => {
  if (location.hash === "#auto") $("go").click();  // the headless-browser test starts a generation this way
}).catch((error) => { $("info").textContent = "error: " + error.message; });
</script>
</body>
</html>
"""


def _sha256_source(tag: str) -> str:
    """CSP source of the page's one inline <tag> element: 'sha256-...' of its text."""
    text = re.search(f"<{tag}>(.*?)</{tag}>", PAGE_HTML, re.S).group(1)
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


PAGE_HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {_sha256_source('script')}; "
                               f"style-src {_sha256_source('style')}; img-src data:; connect-src 'self'; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
