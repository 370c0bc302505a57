"""The conformance suite's tests; run them through ``rtx plugins test`` or ``pytest -p rtx_conformance.plugin``."""
