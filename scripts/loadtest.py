#!/usr/bin/env python3
"""Load-test any OpenAI-compatible server; the same as `llmserve bench serve` (see --help)."""

import argparse
import sys

from llmserve.bench.args import add_bench_arguments
from llmserve.bench.serve import run_bench
from llmserve.errors import LLMServeError

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="loadtest.py", description=__doc__)
    add_bench_arguments(parser)
    try:
        sys.exit(run_bench(parser.parse_args()))
    except LLMServeError as e:
        print(f"loadtest: error: {e.message}", file=sys.stderr)
        sys.exit(2)
