"""The ``rtx`` command as a user runs it: one clear line and exit code 2 on bad input, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import assert_one_line_error, rtx, run_in_process


@pytest.mark.parametrize("args, fragment", [
    (["generate", ""], "prompt is empty"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens must be at least 1"),
    (["generate", "hi", "--max-tokens", "-5"], "max_tokens must be at least 1"),
    (["generate", "hi", "--max-tokens", "4", "--min-tokens", "5"], "min_tokens must be an integer in [0, max_tokens"),
    (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--model", "/no/such/model.gguf"], "model not found"),
    (["generate", "hi", "--model", "dummy:nope"], "unknown dummy shape 'nope'"),
    (["generate", "hi", "--model", __file__], "expected a .gguf file or a directory"),
    (["bench", "--model", "dummy:nope"], "unknown dummy shape 'nope'"),
    (["generate", "hi", "--max-tokens", "many"], "invalid int value"),
    (["bench", "--workload", "nope"], "invalid choice"),
    (["generate", "hi", "--model", "dummy:tiny", "--device", "tpu"], "device 'tpu' is not one the torch backend"),
    (["generate", "hi", "--model", "dummy:tiny", "--kv-host-bytes", "inf"], "not a finite size"),
    (["serve", "--request-timeout", "nan"], "not a finite number"),
    (["serve", "--shutdown-grace", "inf"], "not a finite number"),
    # checked before the model loads and the run starts, not when its results are written
    (["bench", "--json", "/no/such/dir/out.json"], "does not exist"),
    (["loadgen", "--json", "/no/such/dir/out.json"], "does not exist"),
    # tried for real: as root the permission bits say /proc is writable, yet nothing can be made there
    (["bench", "--model", "dummy:tiny", "--json", "/proc/out.json"], "cannot write '/proc/out.json'"),
    (["gates", "--json", "/proc/out.json"], "cannot write '/proc/out.json'"),
    (["chaos", "--json", "/proc/out.json"], "cannot write '/proc/out.json'"),
    (["gates", "--workdir", __file__], "is not a directory"),
    (["gates", "--workdir", "/proc/rtx/work"], "cannot write in '/proc'"),
    (["plugins", "new", "sampler", "foo", "--output-dir", "/proc"], "cannot write in '/proc'"),
    (["plugins", "new", "eviction_policy", "lru", "--output-dir", "/tmp"], "'lru' is already registered by rtx-serve"),
    (["bench", "--num-requests", "-1"], "not at least 1"),
    (["sign", "model.gguf", "--key", "k.pem", "--signature", "/no/such/dir/x.sig"], "does not exist"),
    # a file where a directory belongs, and files that are not PEM: named before anything loads
    (["generate", "hi", "--model", "dummy:tiny", "--kv-disk-dir", __file__], "is not a directory"),
    (["generate", "hi", "--model", "dummy:tiny", "--kv-disk-dir", f"{__file__}/kv"], "test_cli.py is a file"),
    # a mount point's typo: only the last directory is made, for every command that takes the flag
    (["generate", "hi", "--model", "dummy:tiny", "--kv-disk-dir", "/no-such-mount/rtx/kv"],
     "/no-such-mount/rtx does not exist"),
    (["bench", "--model", "dummy:tiny", "--kv-disk-dir", "/no-such-mount/rtx/kv"], "/no-such-mount/rtx does not exist"),
    (["serve", "--model", "dummy:tiny", "--state-dir", __file__], "is not a directory"),
    (["serve", "--model", "dummy:tiny", "--served-model-name", " "], "must not be empty"),
    (["generate", "hi", "--model", "dummy:tiny", "--system", "be brief"], "it needs --chat"),
    (["serve", "--model", "dummy:tiny", "--ssl-certfile", __file__, "--ssl-keyfile", __file__],
     "are not a PEM certificate chain"),
    (["loadgen", "--url", "http://127.0.0.1:99999", "--duration", "1"], "port in [1, 65535]"),
])
def test_bad_input_one_line_exit_2(args, fragment):
    assert_one_line_error(rtx(*args), fragment)


@pytest.mark.parametrize("args, fragment", [
    # Counts with an upper bound, named: the request list grew until memory ran out (W7's long prompts reach the
    # prompt-token bound first), and --serve opens a client per request.
    (["bench", "--num-requests", "99999999999999"], "--num-requests 99999999999999 is more than 390,625"),
    (["bench", "--workload", "W7", "--num-requests", "500000"], "more than 12,207, the most for workload W7"),
    (["bench", "--num-requests", "5000", "--serve"], "--num-requests 5000 with --serve"),
    # Empty is not "none given": the default model or branch was used instead, or a network error came far away.
    (["generate", "hi", "--model", ""], "argument --model: must not be empty, got ''"),
    (["generate", "", "hi"], "argument MODEL: must not be empty"),
    (["bench", "--model", "dummy:tiny", "--revision", ""], "argument --revision: must not be empty"),
    (["pull", "owner/name", "--revision", ""], "argument --revision: must not be empty"),
    (["quantize", "", "--method", "int8", "--out", "/no/such/dir/q"], "argument MODEL: must not be empty"),
    # the model as --model too, as every command that loads one takes it
    (["quantize", "--model", "dummy:tiny", "--method", "int8", "--out", "/proc/rtx-q"],
     "--out /proc/rtx-q: cannot create a directory in /proc"),
    (["quantize", "a.gguf", "--model", "b.gguf", "--method", "int8", "--out", "/tmp/q"], "two models given"),
    (["chat", "--url", ""], "argument --url: must start with http:// or https://"),
    (["chat", "--url", "http://127.0.0.1:99999"], "a port in [1, 65535]; got 'http://127.0.0.1:99999'"),
    (["plan", "--profile-url", ""], "argument --profile-url: must start with http://"),
    # Permission bits say root may write in /proc; only the final write found it could not, after calibration.
    (["quantize", "dummy:tiny", "--method", "int8", "--out", "/proc/rtx-q"],
     "--out /proc/rtx-q: cannot create a directory in /proc"),
])
def test_bad_counts_and_empty_values_are_refused_before_any_work(args, fragment):
    assert_one_line_error(run_in_process(*args), fragment)


@pytest.mark.parametrize("args, fragment", [
    (["--num-kv-blocks", "99999999999999999999"], "--num-kv-blocks"),
    (["--kv-host-bytes", "99999999TiB"], "--kv-host-bytes"),
    (["--kv-disk-dir", "/proc/rtx-kv"], "--kv-disk-dir"),
    (["--max-model-len", "99999999999"], "--max-model-len 99999999999 is more than the 2048 positions of"),
])
def test_memory_no_machine_has_names_the_flag_once_the_weights_are_in(args, fragment):
    # Sizes in bytes are known once the model is: the error comes after the loading lines, one line, no traceback.
    assert_one_line_error(rtx("generate", "hi", "--model", "dummy:tiny", *args), fragment, after_progress=True)


def test_truncated_gguf_is_refused(tmp_path, default_model_file):
    broken = tmp_path / "broken.gguf"
    with open(default_model_file, "rb") as src:
        broken.write_bytes(src.read(5_000_000))
    assert_one_line_error(rtx("generate", "hi", "--model", str(broken)), "broken.gguf")


@pytest.mark.model
def test_prompt_longer_than_context(tmp_path):
    proc = rtx("generate", "word " * 200, "--max-model-len", "64")
    # Counted with the model's tokenizer, once it has loaded.
    assert_one_line_error(proc, "longer than the model's context", after_progress=True)


@pytest.mark.model
def test_generate_streams_text():
    proc = rtx("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "8 tokens" in proc.stderr


def test_plugins_list_shows_builtins():
    proc = rtx("plugins", "list")
    assert proc.returncode == 0, proc.stderr
    for name, kind in [("fcfs", "scheduler"), ("lru", "eviction_policy"), ("lfu", "eviction_policy"),
                       ("default", "sampler"), ("torch", "backend")]:
        line = next((ln for ln in proc.stdout.splitlines() if ln.split()[:2] == [kind, name]), None)
        assert line is not None, proc.stdout
        assert "rtx-serve" in line
    data = json.loads(rtx("plugins", "list", "--json").stdout)
    rows = {(p["name"], p["kind"]): p for p in data["plugins"]}
    assert rows[("torch", "backend")]["available"] is True
    assert rows[("torch", "backend")]["capabilities"]["paged_kv"] is True
    assert rows[("fcfs", "scheduler")]["package"] == "rtx-serve"
    assert data["failures"] == []


def test_plugins_list_fits_100_columns_and_verbose_and_json_say_the_rest(tmp_path):
    # A component with a long name and a long reason for being unavailable: its line is cut, not wrapped.
    reason = "needs the vendor's driver, " * 12
    _install_fake_distribution(
        tmp_path, "rtx-wordy-plugins", {"wordy": "rtx_wordy"},
        {"rtx_wordy": ("from rtxcore.hookspecs import hookimpl\n"
                       "from rtx_plugins.eviction.lru import LRUPolicy\n"
                       "class Wordy(LRUPolicy):\n"
                       "    @classmethod\n"
                       "    def describe(cls):\n"
                       f"        return {{'available': False, 'unavailable_reason': {reason!r}, 'flavour': 'umami'}}\n"
                       "@hookimpl\ndef register_eviction_policies(register):\n"
                       "    register('least-recently-used-with-a-very-long-name', Wordy)\n")})
    env = {"PYTHONPATH": str(tmp_path)}
    table = rtx("plugins", "list", env=env)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100, table.stdout
    data = json.loads(rtx("plugins", "list", "--json", env=env).stdout)
    listed = {tuple(line.split()[:2]) for line in lines[1:]}
    assert {(p["kind"], p["name"]) for p in data["plugins"]} == listed
    wordy = next(p for p in data["plugins"] if p["package"] == "rtx-wordy-plugins")
    assert wordy["unavailable_reason"] == reason and wordy["capabilities"] == {"flavour": "umami"}
    verbose = rtx("plugins", "list", "--verbose", env=env)
    assert verbose.returncode == 0, verbose.stderr
    assert reason.strip() in verbose.stdout and "    flavour: umami" in verbose.stdout
    assert "    plugin: wordy" in verbose.stdout and "    paged_kv: True" in verbose.stdout  # the torch backend's


def _install_fake_distribution(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """A real (minimal) installed distribution: a .dist-info folder with entry points, found by importlib.metadata."""
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[rtx]\n{lines}\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)


def test_broken_plugins_are_reported_and_others_load(tmp_path):
    _install_fake_distribution(
        tmp_path, "rtx-broken-plugins",
        {"explodes": "rtx_explodes", "badtype": "rtx_badtype", "dupe": "rtx_dupe"},
        {
            "rtx_explodes": "raise RuntimeError('boom at import')\n",
            "rtx_badtype": ("from rtxcore.hookspecs import hookimpl\n"
                            "@hookimpl\ndef register_samplers(register):\n    register('notasampler', dict)\n"),
            "rtx_dupe": ("from rtxcore.hookspecs import hookimpl\nfrom rtx_plugins.eviction.lru import LRUPolicy\n"
                         "@hookimpl\ndef register_eviction_policies(register):\n    register('lru', LRUPolicy)\n"),
        })
    env = {"PYTHONPATH": str(tmp_path)}
    data = json.loads(rtx("plugins", "list", "--json", env=env).stdout)
    failures = {f["plugin"]: f for f in data["failures"]}
    assert "boom at import" in failures["explodes"]["error"]
    assert failures["explodes"]["package"] == "rtx-broken-plugins"
    assert "not a subclass" in failures["badtype"]["error"]
    assert "already registered" in failures["dupe"]["error"]
    names = {(p["name"], p["kind"]) for p in data["plugins"]}
    assert {("fcfs", "scheduler"), ("lru", "eviction_policy"), ("torch", "backend")} <= names
    lru = next(p for p in data["plugins"] if p["name"] == "lru")
    assert lru["package"] == "rtx-serve"
    table = rtx("plugins", "list", env=env)
    assert table.returncode == 0 and "boom at import" in table.stdout


def test_a_plugin_that_raises_when_made_is_named_in_one_line(tmp_path):
    _install_fake_distribution(
        tmp_path, "rtx-licensed-plugins", {"licensed": "rtx_licensed"},
        {"rtx_licensed": ("from rtxcore.hookspecs import hookimpl\n"
                          "from rtx_plugins.quantizers.int8 import Int8Quantizer\n"
                          "class Licensed(Int8Quantizer):\n"
                          "    def __init__(self):\n"
                          "        raise RuntimeError('license server unreachable')\n"
                          "@hookimpl\ndef register_quantizers(register):\n    register('licensed', Licensed)\n")})
    proc = rtx("generate", "hi", "--model", "dummy:tiny", "--quantization", "licensed",
               env={"PYTHONPATH": str(tmp_path)})
    assert_one_line_error(proc, "quantizer plugin 'licensed' (rtx-licensed-plugins) failed to start: "
                                "RuntimeError: license server unreachable")


def test_rtx_plugins_env_restricts_loading():
    data = json.loads(rtx("plugins", "list", "--json", env={"RTX_PLUGINS": "fcfs,lru"}).stdout)
    assert {p["name"] for p in data["plugins"]} == {"fcfs", "lru"}


def test_help_and_version_import_no_torch():
    # torch takes seconds to import: `rtx --help`, `--version` and every command's --help must not wait for it.
    import subprocess
    import sys

    code = ("import sys; from rtxcore.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'rtxcore.engine.core', 'rtxcore.server.serving.runtime') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_chat_template_flag(tmp_path):
    from rtxcore.cli.common import engine_config
    from rtxcore.cli.main import build_parser
    from rtxcore.engine.llm import LLM

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<<assistant>>{% endif %}")
    args = build_parser().parse_args(["generate", "--chat-template", str(template), "hi"])
    llm = LLM(engine_config(args))
    assert llm.inputs.apply_chat_template([{"role": "user", "content": "hi"}]) == "<<user>>hi\n<<assistant>>"
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    for path, error in ((bad, "does not parse"), (tmp_path / "missing.jinja", "cannot read")):
        assert_one_line_error(rtx("generate", "--chat-template", str(path), "hi"), error)


@pytest.mark.parametrize("args", [("plugins", "list"), ("plugins", "list", "--json")])
def test_a_reader_that_goes_away_ends_the_command_quietly(args):
    # `rtx plugins list | head`: the pipe is closed before the command writes; no traceback, SIGPIPE's status.
    import signal
    import subprocess

    from tests.helpers.cli import RTX

    proc = subprocess.Popen([RTX, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
