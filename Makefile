# Everything installs from a bare Python 3.11: `make train` and `make test` create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
# The lowest supported torch (pyproject.toml: torch>=2.11,<2.16) and omegaconf (>=2.3) in a venv of
# their own; `make test` gets the newest the ranges allow from the registry.
MIN_VENV := .venv-torch-min
MIN_PY := $(MIN_VENV)/bin/python
MIN_STAMP := $(MIN_VENV)/.installed-dev
TORCH_MIN := 2.11.*
TORCHVISION_MIN := 0.26.*
OMEGACONF_MIN := 2.3.0

.PHONY: install dev train test test-torch-min test-fast test-reliability lint bench figures clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[vision,examples]"
	touch $@

$(DEV_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[vision,examples,dev,data]"
	touch $(STAMP) $@

install: $(STAMP)
dev: $(DEV_STAMP)

train: $(STAMP)
	$(VENV)/bin/polytrain fit --config examples/digits/config.yaml

test: $(DEV_STAMP)
	$(PY) -m pytest -q tests --durations=25

$(MIN_PY):
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_PY) -m pip install -q --upgrade pip

# One resolver run with the pins, so nothing in the dev extras can lift torch above them.
$(MIN_STAMP): pyproject.toml Makefile | $(MIN_PY)
	$(MIN_PY) -m pip install -q "torch==$(TORCH_MIN)" "torchvision==$(TORCHVISION_MIN)" \
		"omegaconf==$(OMEGACONF_MIN)" -e ".[vision,examples,dev,data]"
	$(MIN_PY) -c "import torch, torchvision as tv; v = torch.__version__; assert v.startswith('2.11.'), \
		f'.venv-torch-min holds torch {v}, not 2.11: rm -rf $(MIN_VENV) and run make test-torch-min again'; \
		print('lowest supported: torch', v, 'torchvision', tv.__version__)"
	$(MIN_PY) -c "import omegaconf; v = omegaconf.__version__; assert v == '$(OMEGACONF_MIN)', \
		f'.venv-torch-min holds omegaconf {v}, not $(OMEGACONF_MIN): rm -rf $(MIN_VENV) and run make test-torch-min again'"
	touch $@

# The suite on the lowest supported torch. MIN_PYTEST_ARGS narrows it if ever needed (.ci/run passes none).
test-torch-min: $(MIN_STAMP)
	$(MIN_PY) -m pytest -q tests --durations=25 $(MIN_PYTEST_ARGS)

test-fast: $(DEV_STAMP)
	$(PY) -m pytest -q tests -m "not slow and not reliability"

test-reliability: $(DEV_STAMP)
	$(PY) -m pytest -q tests/reliability -m reliability

# The full battery (5 trials per repeated scenario), one line per scenario with its figure.
.PHONY: reliability
reliability: $(DEV_STAMP)
	$(PY) -m tests.reliability.summary

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check polytrain tests examples benchmarks docs

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

# The pictures in the docs: the digits example trained afresh into runs/figures, its curves drawn from its
# own metrics.csv (README), and the SVG drawings (docs/architecture.md, docs/strategies/composition.md).
figures: $(DEV_STAMP)
	rm -rf runs/figures
	$(VENV)/bin/polytrain fit --config examples/digits/config.yaml trainer.run_dir=runs/figures trainer.enable_progress_bar=false
	$(PY) docs/figures/curves.py runs/figures/version_0/metrics.csv docs/figures/digits-curves.png
	$(PY) docs/figures/diagrams.py

clean:
	rm -rf $(VENV) $(MIN_VENV) runs .pytest_cache
