"""Where llmserve keeps what it builds at run time: $LLMSERVE_CACHE_DIR, else
$XDG_CACHE_HOME/llmserve, else ~/.cache/llmserve. Never beside the package, which may be
installed read-only."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """A folder under the user cache directory (not created here)."""
    root = os.environ.get("LLMSERVE_CACHE_DIR")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmserve")
    return Path(root, *parts)
