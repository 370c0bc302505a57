# Every target does all set-up on a fresh machine first (scripts/setup.sh is idempotent).
.PHONY: setup run test bench lint gates

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/rtx serve

# Two workers, each test file on one of them (module fixtures start servers once); then the tests that time
# something, alone. The slowest tests are listed at the end, for keeping CI within its time.
test: setup
	.venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not serial" --durations=60
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
