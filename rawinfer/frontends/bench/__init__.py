"""Benchmarks: offline throughput, open-loop serving load, the roofline of prefill and decode."""
