"""Benchmarks: ``kvflow bench throughput | latency`` against peers in the same run."""
