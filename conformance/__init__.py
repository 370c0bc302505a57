"""rtx_conformance: the suite every rtx-serve plugin must pass, as a pytest plugin (``rtx_conformance.plugin``).

``rtx plugins test`` runs it through :func:`rtx_conformance.runner.run_suite`; the contracts live in ``checks/``, the
tests that apply them to each registered component in ``suite/``, the gates of ``spec/gates.toml`` in ``gates/``.
"""
