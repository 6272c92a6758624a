"""Benchmarks behind ``tigana bench <case>``: one JSON line per case with the figure, its peer and the ratio."""
