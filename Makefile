# Every target does all set-up on a fresh machine first (scripts/setup.sh is idempotent).
.PHONY: setup run test bench lint gates

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/rtx serve

# Two workers, each test file on one of them (module fixtures start servers once); then the tests that time
# something, alone. The slowest tests are listed at the end, for keeping CI within its time.
# One math thread per process in the parallel part: two workers, each starting servers and subprocesses with torch's
# default of one thread per core, oversubscribe the 2-core CI machine (measured on four of the slowest files,
# 2026-12-03: 380-405 s with the default, 136 s with one thread). The serial part and the gates keep the default.
test: setup
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not serial" --durations=60
	.venv/bin/python -m pytest -q -m serial --durations=10

bench: setup
	.venv/bin/rtx bench --workload cpu --baseline hf

# The phase gates (docs/gates.md): one table, plus JSON and JUnit reports in gates-out/; exit 1 when a gate fails.
gates: setup
	mkdir -p gates-out
	.venv/bin/rtx gates --json gates-out/gates.json --junit gates-out/gates.xml

# ruff (pyflakes, pycodestyle errors, import order, bugbear) over the tree, then mypy over rtxcore (pyproject.toml).
lint: setup
	.venv/bin/ruff check .
	.venv/bin/mypy
