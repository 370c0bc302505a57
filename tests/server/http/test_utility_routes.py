"""vLLM's utility routes and the API's own description: ``/tokenize``, ``/detokenize``, ``/version``,
``/v1/models/{id}``, ``/openapi.json`` and ``/docs``; and ``spec/openapi.yaml`` kept in step with the app's routes.

One ``rtx serve`` on the real default model (module scope), with an API key and two served names, serves the tests
marked ``model``; the others build the app in-process.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import subprocess

import httpx
import openai
import pytest
import yaml

from tests.helpers import REPO
from tests.helpers.server import assert_error, start_server

KEY = "sk-utility"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SPEC = REPO / "spec" / "openapi.yaml"


@pytest.fixture(scope="module")
def server():
    srv = start_server("--no-grpc", "--api-key", KEY, "--served-model-name", "rtx-a", "rtx-b")
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture
def tiny_runtime():
    from rtxcore.engine.config import EngineConfig
    from rtxcore.server.serving.runtime import ServingRuntime

    runtime = ServingRuntime(EngineConfig(model="dummy:tiny"))
    yield runtime
    runtime.stop()


# -- /tokenize and /detokenize -----------------------------------------------------------------------------------


@pytest.mark.model
def test_tokenize_counts_a_prompt_as_completions_do(http):
    tok = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert set(tok) == {"count", "max_model_len", "tokens"} and tok["count"] == len(tok["tokens"]) > 0
    assert tok["max_model_len"] == http.get("/v1/models").json()["data"][0]["max_model_len"]
    usage = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == tok["count"]

    named = http.post("/tokenize", json={"prompt": PROMPT, "model": "rtx-b", "return_token_strs": True}).json()
    assert named["tokens"] == tok["tokens"] and len(named["token_strs"]) == tok["count"]
    assert "".join(named["token_strs"]).replace("\u0120", " ") == PROMPT  # byte-level BPE spells a space 'Ġ'
    empty = http.post("/tokenize", json={"prompt": ""}).json()
    assert empty["count"] == len(empty["tokens"])  # nothing but what the tokenizer adds; not an error


@pytest.mark.model
def test_tokenize_renders_messages_as_chat_completions_do(http):
    tok = http.post("/tokenize", json={"messages": CHAT}).json()
    usage = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == tok["count"] == len(tok["tokens"])
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    assert http.post("/tokenize", json={"messages": parts}).json()["tokens"] == tok["tokens"]
    # Without the assistant's turn opening: a strict prefix of the same chat.
    bare = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert len(bare) < tok["count"] and tok["tokens"][:len(bare)] == bare


@pytest.mark.model
def test_continue_final_message_leaves_the_last_turn_open(http):
    started = "The capital of France is"
    convo = [*CHAT, {"role": "assistant", "content": started}]
    tok = http.post("/tokenize", json={"messages": convo, "continue_final_message": True}).json()
    text = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n" + started)  # no end of turn after it, no new turn
    closed = http.post("/tokenize", json={"messages": convo, "add_generation_prompt": False}).json()["tokens"]
    assert closed[:tok["count"]] == tok["tokens"] and len(closed) > tok["count"]
    # A chat completion renders the same prompt and goes on from it: the same tokens as a completion of that prompt.
    chat = http.post("/v1/chat/completions", json={"messages": convo, "continue_final_message": True,
                                                   "add_generation_prompt": False, "max_tokens": 6,
                                                   "temperature": 0}).json()
    plain = http.post("/v1/completions", json={"prompt": tok["tokens"], "max_tokens": 6, "temperature": 0}).json()
    assert chat["usage"]["prompt_tokens"] == tok["count"]
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    # Template variables of any name, those of Python parameters along the way included (they once clashed: 500).
    odd = {"self": 1, "source": "x", "special_tokens": 2, "template_vars": 3}
    assert (http.post("/tokenize", json={"messages": convo, "chat_template_kwargs": odd}).json()["count"]
            == http.post("/tokenize", json={"messages": convo}).json()["count"])
    assert http.post("/v1/chat/completions", json={"messages": CHAT, "chat_template_kwargs": odd,
                                                   "max_tokens": 1}).status_code == 200
    for body, param in (({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
                        ({"continue_final_message": True, "messages": [*CHAT, {"role": "assistant", "content": " "}]},
                         "messages"),
                        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                        ({"chat_template": "{{ messages }}"}, "chat_template")):
        assert_error(http.post("/v1/chat/completions", json={"messages": convo, "max_tokens": 1, **body}), 400, param)


@pytest.mark.model
def test_truncate_prompt_tokens_keeps_the_end_of_each_prompt(http):
    long = "One two three four five six seven eight nine ten. " + PROMPT
    ids = http.post("/tokenize", json={"prompt": long}).json()["tokens"]
    greedy = {"max_tokens": 4, "temperature": 0}
    cut = http.post("/v1/completions", json={"prompt": long, "truncate_prompt_tokens": 6, "echo": True,
                                             **greedy}).json()
    tail = http.post("/v1/completions", json={"prompt": ids[-6:], **greedy}).json()
    assert cut["usage"]["prompt_tokens"] == 6
    echoed = http.post("/detokenize", json={"tokens": ids[-6:]}).json()["prompt"]
    assert cut["choices"][0]["text"] == echoed + tail["choices"][0]["text"]  # the echo is what the model saw
    whole = http.post("/v1/completions", json={"prompt": long, "truncate_prompt_tokens": -1, **greedy}).json()
    assert whole["usage"]["prompt_tokens"] == len(ids)  # -1: as much as the context holds, here all of it

    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "truncate_prompt_tokens": 5, **greedy}).json()
    assert chat["usage"]["prompt_tokens"] == 5

    vectors = http.post("/v1/embeddings", json={"input": [ids, ids[-2:]], "truncate_prompt_tokens": 2}).json()
    assert vectors["usage"]["prompt_tokens"] == 4
    assert vectors["data"][0]["embedding"] == pytest.approx(vectors["data"][1]["embedding"], abs=1e-5)
    assert http.post("/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 2}).json()["usage"] == {
        "prompt_tokens": 2, "total_tokens": 2}
    for bad in (0, -2, "3", True, 1.5):
        for path, body in (("/v1/completions", {"prompt": long}), ("/v1/chat/completions", {"messages": CHAT}),
                           ("/v1/embeddings", {"input": long})):
            assert_error(http.post(path, json={**body, "truncate_prompt_tokens": bad}), 400, "truncate_prompt_tokens")


@pytest.mark.model
def test_detokenize_gives_back_the_text(http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids, "model": "rtx-a"}).json() == {"prompt": PROMPT}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    chat = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert "<|im_start|>" in http.post("/detokenize", json={"tokens": chat}).json()["prompt"]  # specials kept


@pytest.mark.model
@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "messages"),
    ("/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": 1}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": "yes"}, 400, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": ["enable_thinking"]}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/tokenize", {"prompt": "a", "model": 7}, 400, "model"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
])
def test_tokenizer_routes_refuse_bad_input_naming_the_field(http, path, body, status, param):
    assert_error(http.post(path, json=body), status, param)


@pytest.mark.model
def test_tokenizer_routes_need_the_api_key_and_json(server, http):
    assert_error(httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}), 401)
    assert_error(httpx.post(server.base_url + "/detokenize", json={"tokens": [1]}), 401)
    assert_error(http.post("/tokenize", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert httpx.get(server.base_url + "/health").status_code == 200  # the probes stay open


def test_tokenizer_routes_without_a_tokenizer_or_a_model(tiny_runtime):
    from starlette.testclient import TestClient

    from rtxcore.server.http import build_app

    with TestClient(build_app(tiny_runtime)) as c:
        assert_error(c.post("/tokenize", json={"prompt": "hi"}), 503)  # still loading
        tiny_runtime.load()
        assert_error(c.post("/tokenize", json={"prompt": "hi"}), 400, "prompt")  # dummy models have no tokenizer
        assert_error(c.post("/tokenize", json={"messages": CHAT}), 400, "messages")
        assert_error(c.post("/detokenize", json={"tokens": [1, 2]}), 400, "tokens")


# -- /version and /v1/models/{id} --------------------------------------------------------------------------------


@pytest.mark.model
def test_version(http):
    from rtxcore import __version__

    assert http.get("/version").json() == {"version": __version__}


@pytest.mark.model
def test_each_served_name_is_a_model_id(server, http):
    listed = http.get("/v1/models").json()["data"][0]
    for name in ("rtx-a", "rtx-b"):
        assert http.get(f"/v1/models/{name}").json() == {**listed, "id": name}
    # Another name requests may give (the source's own) answers with the first served name.
    assert http.get("/v1/models/smollm2-135m").json() == listed
    error = assert_error(http.get("/v1/models/nope"), 404, "model")
    assert error["code"] == "model_not_found" and error["type"] == "not_found_error"
    assert_error(http.get("/v1/models/org/nope"), 404, "model")  # ids may hold a '/'

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert client.models.retrieve("rtx-b").id == "rtx-b"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


# -- /openapi.json and /docs -------------------------------------------------------------------------------------


@pytest.mark.model
def test_openapi_json_is_the_spec(http):
    resp = http.get("/openapi.json")
    assert resp.headers["content-type"] == "application/json"
    assert resp.json() == yaml.safe_load(SPEC.read_text())


@pytest.mark.model
def test_docs_page_renders_every_operation_of_the_spec(server, http):
    resp = http.get("/docs")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    # Open without a key, as /openapi.json and /version are: a browser cannot send one (vLLM guards only /v1/*).
    for path in ("/docs", "/openapi.json", "/version"):
        assert httpx.get(server.base_url + path).status_code == 200, path
    # The page's inline script and style run under its Content-Security-Policy: their hashes are listed there.
    policy = resp.headers["content-security-policy"]
    for tag in ("script", "style"):
        source = re.search(rf"<{tag}>(.*?)</{tag}>", resp.text, re.DOTALL).group(1)
        assert f"'sha256-{base64.b64encode(hashlib.sha256(source.encode()).digest()).decode()}'" in policy, tag
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the page's script is not run")
    script = re.search(r"<script>(.*?)</script>", resp.text, re.DOTALL).group(1)
    spec = http.get("/openapi.json").json()
    rendered = subprocess.run(["node", "-e", _DOM_HARNESS + script], input=json.dumps(spec), capture_output=True,
                              text=True, timeout=60, check=True).stdout
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            assert f"{method.upper()} {path} {operation.get('summary', '')}" in rendered, (method, path)


# Just enough of a DOM for the page's script: it renders into element trees printed as text once the script is done.
_DOM_HARNESS = """
const spec = JSON.parse(require("fs").readFileSync(0, "utf8"));
class Node {
  constructor(tag) { this.tag = tag; this.children = []; this.text = ""; }
  set textContent(value) { this.text = String(value); this.children = []; }
  append(...items) { this.children.push(...items.map((i) => typeof i === "string" ? {text: i, children: []} : i)); }
}
const text = (n) => n.text + n.children.map(text).join(n.tag === "summary" ? " " : "\\n");
const nodes = {};
globalThis.document = {createElement: (tag) => new Node(tag), getElementById: (id) => nodes[id] ??= new Node(id)};
globalThis.fetch = async () => ({ok: true, json: async () => spec});
process.on("beforeExit", () => {
  if (!nodes.done) { nodes.done = 1; console.log(text(nodes.operations).replace(/ +/g, " ")); }
});
"""


# -- spec/openapi.yaml against the app ---------------------------------------------------------------------------


def test_openapi_spec_and_app_routes_match(tiny_runtime):
    """Every route the app serves (but those left out of the schema) is in the spec, and every path and method of
    the spec is served; path parameters are declared, operation ids unique."""
    from rtxcore.server.http import build_app

    spec = yaml.safe_load(SPEC.read_text())
    methods = {"get", "put", "post", "delete", "patch", "options", "head"}
    documented = {(path, method.upper()) for path, item in spec["paths"].items() for method in item
                  if method in methods}
    app = build_app(tiny_runtime)
    served = {(re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path), method)
              for route in app.routes if getattr(route, "include_in_schema", True)
              for method in route.methods if method != "HEAD"}
    assert sorted(served - documented) == [], "routes missing from spec/openapi.yaml"
    assert sorted(documented - served) == [], "paths of spec/openapi.yaml that no route serves"

    operation_ids = [op["operationId"] for item in spec["paths"].values() for m, op in item.items() if m in methods]
    assert len(operation_ids) == len(set(operation_ids)) == len(documented)
    for path, item in spec["paths"].items():
        for method, op in item.items():
            declared = {p["name"] for p in op.get("parameters", []) if p.get("in") == "path"}
            assert declared == set(re.findall(r"\{(\w+)\}", path)), (method, path)


def test_openapi_json_of_a_server_without_the_spec_is_a_json_404(tmp_path):
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from rtxcore.server.http.docs_routes import DocsRoutes
    from rtxcore.server.http.errors import APIError, api_error_handler

    app = Starlette(routes=DocsRoutes(tmp_path / "openapi.yaml").routes(),
                    exception_handlers={APIError: api_error_handler})
    with TestClient(app) as c:
        assert "spec/openapi.yaml" in assert_error(c.get("/openapi.json"), 404)["message"]
        assert c.get("/docs").status_code == 200  # the page still loads, and says what went wrong
