"""Benchmarks: `python -m harnessrl.benchmarks.NAME`, each ending with one `NAME: key=value ...` line."""
