"""Benchmark harness: `sparda bench` (docs/bench.md)."""
