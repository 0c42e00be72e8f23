# Everything runs inside .venv, created from nothing on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
JOBS ?= 2

.PHONY: demo test test-all bench lint ops-table opinfo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test,cli]"
	touch $(STAMP)

## Convert the bundled example model, run it on the Core AI runtime, compare with PyTorch.
demo: $(STAMP)
	$(BIN)/python -m coreai_torch.demo

## The fast suite (run by CI).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadgroup -m "not slow"

## Every test, including the slow sweeps.
test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadgroup

## Conversion time, peak memory and runtime latency of the benchmark models, and the
## conversion of a 1.26B Llama against the disk's write floor (about 8 GB of free memory).
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run --ablation --large

lint: $(STAMP)
	$(BIN)/ruff check coreai_torch tests benchmarks
	$(BIN)/ruff format --check coreai_torch tests benchmarks

## Regenerate docs/ops.md, the op coverage table.
ops-table: $(STAMP)
	$(BIN)/python -m coreai_torch.coverage --write docs/ops.md

## Only the OpInfo sweep (every op_db entry, JOBS workers): tests/opinfo/results.json + docs/ops.md.
opinfo: $(STAMP)
	$(BIN)/python -m tests.opinfo.sweep --jobs $(JOBS)
	$(BIN)/python -m coreai_torch.coverage --write docs/ops.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
