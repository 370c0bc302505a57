"""The security gate, three counts that must be 0:

- a model whose signed contents were changed by one byte, served in strict mode (``--require-signed-models``), that
  ``rtx serve`` does not refuse; and, as the control that keeps the check honest, the untampered signed model refused;
- problems of ``rtx sbom --validate``: a document that fails the CycloneDX schema, or lacks rtx-serve or torch;
- API keys found where they must never be: the server's log, ``/metrics`` and its request journal are searched for
  each key sent (the right one and a wrong one), its SHA-256 and any 12 hex digits of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from rtxcore.gates.outcome import Check
from rtxcore.gates.served import ServedProcess
from rtxcore.gates.thresholds import require
from rtxcore.models.resolve import resolve_model

GATE = "security"


@dataclass(frozen=True, slots=True)
class SecuritySettings:
    max_findings: int

    def __post_init__(self) -> None:
        require(self.max_findings >= 0, "max_findings", ">= 0", self.max_findings)


def run(settings: SecuritySettings, workdir: Path, say) -> list[Check]:
    say("security: a tampered model in strict mode...")
    signing = _signing_findings(workdir)
    say("security: rtx sbom --validate...")
    sbom = _sbom_findings(workdir)
    say("security: API keys in logs, metrics and the journal...")
    keys = _key_findings(workdir)
    limit = settings.max_findings
    return [Check(GATE, "signed models: tampered served or signed refused", len(signing), limit, "<=",
                  "; ".join(signing)),
            Check(GATE, "SBOM: schema or content problems", len(sbom), limit, "<=", "; ".join(sbom)),
            Check(GATE, "API keys or their hashes in logs, metrics, journal", len(keys), limit, "<=",
                  "; ".join(keys))]


def _rtx(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    rtx = str(Path(sys.executable).with_name("rtx"))
    return subprocess.run([rtx, *args], capture_output=True, text=True, timeout=timeout, check=False)


def _signing_findings(workdir: Path) -> list[str]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from rtxcore.provenance.signing import sign_model

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = workdir / "signer.pem", workdir / "signer.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    model = workdir / "signed" / Path(resolve_model(None).path).name
    model.parent.mkdir(exist_ok=True)
    shutil.copyfile(resolve_model(None).path, model)
    sign_model(model, private)
    findings = []
    strict = ["--signing-public-key", str(public), "--require-signed-models"]
    # The control: the signed model verifies (else a check that refuses everything would pass).
    verified = _rtx("verify", str(model), "--key", str(public))
    if verified.returncode != 0:
        findings.append(f"the untampered signed model fails `rtx verify`: {verified.stderr.strip()[-200:]}")
    with model.open("r+b") as f:  # one byte in the middle of the tensor data
        f.seek(model.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    code, output = _serve_until_refused(["--model", str(model), *strict], workdir / "tampered-server.log")
    if code != 2 or "signature check failed" not in output:
        findings.append(f"the tampered model was not refused (exit {code}): {output.strip()[-200:]}")
    return findings


def _serve_until_refused(args: list[str], log: Path, timeout_s: float = 120.0) -> tuple[int | None, str]:
    """``rtx serve`` that must refuse to start: its exit code and output, or (None, output) when it loaded the model
    (it says so with a line naming the model and its backend; it is then stopped)."""
    rtx = str(Path(sys.executable).with_name("rtx"))
    with log.open("w") as out:
        proc = subprocess.Popen([rtx, "serve", "--host", "127.0.0.1", "--port", "0", "--no-grpc", *args],
                                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and " backend=" not in log.read_text(errors="replace") \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            return None, log.read_text(errors="replace")
    return proc.returncode, log.read_text(errors="replace")


def _sbom_findings(workdir: Path) -> list[str]:
    out = workdir / "sbom.json"
    result = _rtx("sbom", "--validate", "--out", str(out))
    if result.returncode != 0:
        return [f"rtx sbom --validate failed (exit {result.returncode}): {result.stderr.strip()[-200:]}"]
    document = json.loads(out.read_text())
    names = {c.get("name", "").lower() for c in document.get("components", [])}
    missing = [name for name in ("rtx-serve", "torch") if name not in names]
    problems = [] if document.get("bomFormat") == "CycloneDX" else ["not a CycloneDX document"]
    return problems + [f"{name} is not among its components" for name in missing]


def _key_findings(workdir: Path) -> list[str]:
    right, wrong = "sk-gates-" + os.urandom(12).hex(), "sk-wrong-" + os.urandom(12).hex()
    state = workdir / "keys-state"
    log = workdir / "keys-server.log"
    with ServedProcess(["--state-dir", str(state)], log, env={"RTX_API_KEYS": f"gates={right}"}) as server:
        for key in (right, wrong):
            headers = {"Authorization": f"Bearer {key}"}
            body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
            httpx.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=120, trust_env=False)
            with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True},
                              headers=headers, timeout=120, trust_env=False) as resp:
                resp.read()
        metrics = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {right}"},
                            timeout=30, trust_env=False).text
    places = {"/metrics": metrics, "the server log": log.read_text(errors="replace")}
    for path in sorted(p for p in state.rglob("*") if p.is_file()):
        places[f"journal file {path.name}"] = path.read_bytes().decode("utf-8", errors="replace")
    findings = []
    for label, key in (("the API key", right), ("a wrong key sent", wrong)):
        digest = hashlib.sha256(key.encode()).hexdigest()
        secrets = [key, *(digest[i:i + 12] for i in range(0, len(digest) - 11))]
        findings += [f"{label} (or 12 hex digits of its SHA-256) in {where}" for where, text in places.items()
                     if any(secret in text for secret in secrets)]
    return findings
