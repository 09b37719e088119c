#!/usr/bin/env python3
"""Load-test any OpenAI-compatible server: the same as `llmserve bench serve` (see --help)."""

import sys

from llmserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))
