# `make demo` and `make test` each build .venv from pyproject.toml when it is
# missing or older than pyproject.toml, then run. The demo installs the package and
# its dependencies only; test, lint and bench add the test extras (torch, transformers,
# pytest, ruff, pyarrow, datasets).
PYTHON ?= python3.11
VENV := .venv
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed-test

.PHONY: demo test lint bench

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --upgrade pip

$(DEMO_STAMP): pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -e .
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -e ".[test]"
	touch $(STAMP) $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/python -m models.cli.demo

test: $(STAMP)
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(VENV)/bin/python -m pytest tests property_tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks.eager --out docs/benchmarks.md
