# Every target does all set-up on a fresh machine first (scripts/setup.sh is idempotent).
.PHONY: setup run test bench lint

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/rtx serve

test: setup
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/rtx bench --workload cpu --baseline hf

# ruff (pyflakes, pycodestyle errors, import order, bugbear) over the tree, then mypy over rtxcore (pyproject.toml).
lint: setup
	.venv/bin/ruff check .
	.venv/bin/mypy
