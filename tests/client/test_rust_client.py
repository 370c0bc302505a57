"""The Rust client (clients/rust/rtx-client): ``cargo fmt`` and ``cargo clippy`` clean, then its ``cargo test`` suite
and its examples against a live ``rtx serve`` on the default model.

The server keeps a journal (so cut streams resume) and has two tenants: one unlimited, one allowed a single request
at a time (so a 429 with ``Retry-After`` is easy to provoke). tests/live.rs holds the checks: chat, completions, the
native routes, streaming, a stream cut by the client and resumed with no gap and no duplicate, a 429 retried after
its ``Retry-After``, bad requests surfacing the server's message, lanes, trace context, idempotency keys, timeouts.

cargo builds offline from Debian's packaged crates (scripts/setup.sh installs them); one build, in the crate's
``target/``, serves every test, and it happens before the server starts so the two do not share the CPU. Skipped only
when no Rust toolchain is installed.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.server import start_server

CRATE = Path(__file__).resolve().parents[2] / "clients" / "rust" / "rtx-client"
EXAMPLES = CRATE / "target" / "debug" / "examples"
BUILD_TIMEOUT_S = 900
NUM_LIVE_TESTS = 9


def find_cargo() -> str | None:
    """cargo on PATH, else where rustup puts it (``$CARGO_HOME/bin``, ``~/.cargo/bin``), which a non-login shell
    may not have on its PATH."""
    found = shutil.which("cargo")
    if found:
        return found
    cargo_home = Path(os.environ.get("CARGO_HOME") or Path.home() / ".cargo")
    candidate = cargo_home / "bin" / "cargo"
    return str(candidate) if os.access(candidate, os.X_OK) else None


@pytest.fixture(scope="module")
def cargo() -> str:
    found = find_cargo()
    if found is None:
        pytest.skip("no Rust toolchain (cargo) installed: the Rust client is not built here")
    return found


def cargo_env(cargo: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    # The toolchain's directory first, so cargo finds the rustc, rustfmt and clippy-driver beside it.
    path = os.pathsep.join([str(Path(cargo).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "CARGO_INCREMENTAL": "0", "CARGO_TERM_COLOR": "never", **(extra or {})}


def run_cargo(cargo: str, *args: str, env: dict[str, str] | None = None, timeout: float = BUILD_TIMEOUT_S
              ) -> subprocess.CompletedProcess:
    result = subprocess.run([cargo, *args], cwd=CRATE, env=cargo_env(cargo, env), capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, (
        f"cargo {' '.join(args)} failed ({result.returncode}); the crates come from Debian's librust-*-dev packages "
        f"(scripts/setup.sh installs them)\n--- stdout ---\n{result.stdout[-20000:]}\n"
        f"--- stderr ---\n{result.stderr[-20000:]}")
    return result


def test_rustfmt_and_clippy_are_clean(cargo):
    run_cargo(cargo, "fmt", "--check")
    run_cargo(cargo, "clippy", "--locked", "--all-targets", "--", "-D", "warnings")


@pytest.fixture(scope="module")
def built(cargo) -> str:
    """The library, its tests and its examples, built once."""
    run_cargo(cargo, "test", "--locked", "--no-run")
    return cargo


@pytest.fixture(scope="module")
def keys() -> dict[str, str]:
    return {name: f"sk-{secrets.token_hex(8)}" for name in ("RTX_RUST_TEST_KEY", "RTX_RUST_TEST_LIMITED_KEY")}


@pytest.fixture(scope="module")
def server(built, keys, tmp_path_factory):
    """``rtx serve`` on the default model with a journal and two tenants (keys from the environment)."""
    config = tmp_path_factory.mktemp("rust-client") / "serve.toml"
    config.write_text("""
[tenants.main]
key_env = "RTX_RUST_TEST_KEY"

[tenants.limited]
key_env = "RTX_RUST_TEST_LIMITED_KEY"
max_concurrency = 1
""")
    state_dir = tmp_path_factory.mktemp("rust-client-state")
    process = start_server("--no-grpc", "--state-dir", str(state_dir), "--config", str(config), env=keys)
    yield process
    process.stop()


def test_cargo_test_against_a_live_server(built, server, keys):
    env = {"RTX_TEST_BASE_URL": server.base_url, "RTX_TEST_API_KEY": keys["RTX_RUST_TEST_KEY"],
           "RTX_TEST_LIMITED_API_KEY": keys["RTX_RUST_TEST_LIMITED_KEY"]}
    # Every live test at once: the server batches their requests.
    result = run_cargo(built, "test", "--locked", "--", "--include-ignored", "--test-threads", str(NUM_LIVE_TESTS),
                       env=env, timeout=600)
    output = result.stdout + result.stderr
    summaries = re.findall(r"test result: ok\. (\d+) passed; 0 failed; (\d+) ignored", output)
    assert summaries and all(ignored == "0" for _, ignored in summaries), output  # the live tests did run
    assert f"running {NUM_LIVE_TESTS} tests" in output, output


def test_the_examples_run_against_the_server(built, server, keys):
    env = {**os.environ, "RTX_BASE_URL": server.base_url, "RTX_API_KEY": keys["RTX_RUST_TEST_KEY"]}
    # Both at once: the server batches them.
    runs = {name: subprocess.Popen([str(EXAMPLES / name), *args], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            for name, args in (("stream_chat", ["Say hello."]), ("resume_stream", []))}
    outputs = {}
    for name, run in runs.items():
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, f"{name} failed\n{stdout}\n{stderr}"
        outputs[name] = stdout
    assert outputs["stream_chat"].strip()
    assert re.search(r'^before the cut \(up to event 4\): ".+"$', outputs["resume_stream"], re.M), outputs
    assert re.search(r'^after it: ".+"$', outputs["resume_stream"], re.M), outputs
