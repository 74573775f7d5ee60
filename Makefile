# Everything installs from a bare Python 3.11: `make train` and `make test` create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: install dev train test test-fast test-reliability lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[vision,examples]"
	touch $@

$(DEV_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[vision,examples,dev]"
	touch $(STAMP) $@

install: $(STAMP)
dev: $(DEV_STAMP)

train: $(STAMP)
	$(VENV)/bin/polytrain fit --config examples/digits/config.yaml

test: $(DEV_STAMP)
	$(PY) -m pytest -q tests

test-fast: $(DEV_STAMP)
	$(PY) -m pytest -q tests -m "not slow and not reliability"

test-reliability: $(DEV_STAMP)
	$(PY) -m pytest -q tests/reliability -m reliability

# The full battery (5 trials per repeated scenario), one line per scenario with its figure.
.PHONY: reliability
reliability: $(DEV_STAMP)
	$(PY) -m tests.reliability.summary

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check polytrain tests examples benchmarks

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache
