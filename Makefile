# Both targets do all set-up on a fresh machine first (scripts/setup.sh is idempotent).
.PHONY: setup run test bench

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/rtx serve

test: setup
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/rtx bench --workload cpu --baseline hf
