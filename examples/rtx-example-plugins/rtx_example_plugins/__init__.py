"""Example rtx-serve plugins, packaged the way a third party would: see the README next to pyproject.toml."""
