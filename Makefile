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

# Two pytest-xdist workers (TEST_JOBS), one per core of a CI machine: the suite is
# single-threaded Python and XLA compiles. Whole files go to one worker (loadfile), so a
# module's fixtures are built once; property_tests first, as its files are the longest.
TEST_JOBS ?= 2

test: $(STAMP)
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(VENV)/bin/python -m pytest \
		-n $(TEST_JOBS) --dist loadfile property_tests tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks.eager --out docs/benchmarks.md
