"""Benchmarks. `llmserve bench serve` (and scripts/loadtest.py): load-test any OpenAI-compatible server."""
