# `make demo` and `make test` each build .venv from pyproject.toml when it is
# missing or older than pyproject.toml, then run.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --upgrade pip
	$(VENV)/bin/python -m pip install -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m models.demo

test: $(STAMP)
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(VENV)/bin/python -m pytest tests property_tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks.eager --out docs/benchmarks.md
