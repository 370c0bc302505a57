"""``rtx gates``: the seed's phase gates (throughput, latency, cache, reliability, security, quality) run against the
default model on this machine, each a ratio or a count held to ``spec/gates.toml``'s ``[phase.*]`` thresholds.

One module per gate; each returns :class:`~rtxcore.gates.outcome.Check` lines (a figure, its threshold, a verdict).
:mod:`rtxcore.gates.runner` runs the gates asked for and :mod:`rtxcore.gates.outcome` reports them (table, JSON,
JUnit XML, and the last commit at which a failing check passed). docs/gates.md says what each measures and why.
"""

# Every gate, in the order the report lists them.
GATES = ("throughput", "latency", "cache", "reliability", "security", "quality")
