"""``GET /openapi.json``: ``spec/openapi.yaml`` as JSON; ``GET /docs``: a page listing its operations.

The page is self-contained (no Swagger UI or Redoc: nothing is fetched from the internet) and renders the spec with
a little plain JavaScript. The spec is read once, on the first request that needs it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from rtxcore import spec_files
from rtxcore.server.http.errors import APIError

# spec/openapi.yaml in a checkout, package data in a wheel (rtxcore/spec_files.py).
OPENAPI_SPEC = spec_files.spec_path("openapi.yaml")

_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 60rem; padding: 1rem 1.5rem; color: #222; }
h2 { border-bottom: 1px solid #ddd; margin-top: 2rem; } code { font: 14px ui-monospace, monospace; }
details { border: 1px solid #ddd; border-radius: 4px; margin: .4rem 0; padding: .3rem .6rem; }
summary { cursor: pointer; } .method { display: inline-block; width: 4.5rem; font-weight: 600; }
.get { color: #0a6ebd; } .post { color: #1a7f37; } .delete { color: #b42318; } .put, .patch { color: #9a6700; }
.muted, .error { color: #666; } .error { color: #b42318; } pre { white-space: pre-wrap; }
"""

_SCRIPT = """
(async () => {
  const el = (tag, cls, text) => {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = text;
    return node;
  };
  const main = document.getElementById("operations");
  let spec;
  try {
    const resp = await fetch("openapi.json", {headers: {Accept: "application/json"}});
    if (!resp.ok) throw new Error(`${resp.status}: ${await resp.text()}`);
    spec = await resp.json();
  } catch (err) {
    main.append(el("p", "error", `Could not load openapi.json (${err.message})`));
    return;
  }
  const ref = (obj) => {  // a local $ref ("#/components/...") to what it names
    if (!obj || !obj.$ref) return obj;
    return obj.$ref.slice(2).split("/").reduce((node, key) => node && node[key], spec);
  };
  const refName = (schema) => schema && schema.$ref ? schema.$ref.split("/").pop() : (schema && schema.type) || "";
  document.title = spec.info.title;
  document.getElementById("title").textContent = `${spec.info.title} ${spec.info.version}`;
  document.getElementById("summary").textContent = spec.info.summary || "";
  document.getElementById("description").textContent = spec.info.description || "";
  const groups = new Map((spec.tags || []).map((tag) => [tag.name, {tag, ops: []}]));
  const methods = ["get", "put", "post", "delete", "patch", "head", "options"];
  for (const [path, item] of Object.entries(spec.paths || {})) {
    for (const method of methods.filter((m) => item[m])) {
      const op = item[method];
      const name = (op.tags || ["other"])[0];
      if (!groups.has(name)) groups.set(name, {tag: {name}, ops: []});
      groups.get(name).ops.push({path, method, op});
    }
  }
  for (const {tag, ops} of groups.values()) {
    if (!ops.length) continue;
    const section = el("section");
    section.append(el("h2", "", tag.name), el("p", "muted", tag.description || ""));
    for (const {path, method, op} of ops) {
      const box = el("details");
      box.id = op.operationId || `${method} ${path}`;
      const head = el("summary");
      head.append(el("span", `method ${method}`, method.toUpperCase()), el("code", "", path), " ",
                  el("span", "muted", op.summary || ""));
      box.append(head);
      if (op.description) box.append(el("pre", "", op.description));
      const params = (op.parameters || []).map(ref).filter(Boolean);
      if (params.length) {
        const list = el("ul");
        for (const p of params) list.append(el("li", "", `${p.name} (${p.in}${p.required ? ", required" : ""})`));
        box.append(el("h4", "", "Parameters"), list);
      }
      const body = op.requestBody && ref(op.requestBody);
      if (body && body.content) {
        const kinds = Object.entries(body.content).map(([type, media]) => `${type}: ${refName(media.schema)}`);
        box.append(el("h4", "", "Request body"), el("p", "", kinds.join("; ")));
      }
      const list = el("ul");
      for (const [code, response] of Object.entries(op.responses || {})) {
        list.append(el("li", "", `${code}: ${(ref(response) || {}).description || ""}`));
      }
      box.append(el("h4", "", "Responses"), list);
      section.append(box);
    }
    main.append(section);
  }
})();
"""

_PAGE = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rtx-serve API</title>
<style>{_STYLE}</style>
</head>
<body>
<header>
<h1 id="title">rtx-serve API</h1>
<p id="summary"></p>
<p><a href="openapi.json">openapi.json</a></p>
<details><summary>About this API</summary><pre id="description"></pre></details>
</header>
<main id="operations"></main>
<script>{_SCRIPT}</script>
</body>
</html>
"""


def _source_hash(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


# Only this page's own script and style run, and it may only fetch from this server.
_PAGE_HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {_source_hash(_SCRIPT)}; "
                               f"style-src {_source_hash(_STYLE)}; connect-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


class DocsRoutes:
    def __init__(self, spec_path: Path = OPENAPI_SPEC):
        self.spec_path = spec_path
        # The spec as JSON bytes, read on first use (parsing the YAML takes a while; most servers never need it).
        self._spec_json: bytes | None = None

    def routes(self) -> list[Route]:
        return [
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/docs", self.docs, methods=["GET"]),
        ]

    async def openapi(self, request: Request) -> Response:
        if self._spec_json is None:
            self._spec_json = await asyncio.to_thread(self._read_spec)
        return Response(self._spec_json, media_type="application/json")

    async def docs(self, request: Request) -> Response:
        return HTMLResponse(_PAGE, headers=_PAGE_HEADERS)

    def _read_spec(self) -> bytes:
        if not self.spec_path.is_file():
            raise APIError(404, "the OpenAPI spec is not installed with this server (it is spec/openapi.yaml in "
                           "the source tree)")
        try:
            import yaml  # type: ignore[import-untyped]  # PyYAML ships no type information
        except ImportError:
            raise APIError(500, "serving the OpenAPI spec needs PyYAML (pip install pyyaml)") from None
        spec: Any = yaml.load(self.spec_path.read_text(encoding="utf-8"),
                              Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        return json.dumps(spec, separators=(",", ":")).encode()
