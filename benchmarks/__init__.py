"""Side-by-side benchmarks that print tables (run each with ``python -m benchmarks.<name>``).

They are never run as timed tests; see ``benchmarks/README.md`` for the figures measured.
"""
