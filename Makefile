# Both targets do all set-up on a fresh machine first (scripts/setup.sh is idempotent).
.PHONY: setup run test bench

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/rtx generate --chat "Explain in two sentences why a KV cache speeds up text generation."

test: setup
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/rtx bench --workload cpu --baseline hf
