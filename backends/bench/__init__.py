"""Benchmark harness (``python -m backends.bench``): drivers (HTTP gateway, Triton token2wav, in-process
pipeline), per-request metrics with a playback-underrun model, tables, results.json and plots."""
