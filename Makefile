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

.PHONY: install dev train test test-torch-min test-fast test-reliability coverage lint bench figures clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# TORCH_INDEX: a wheel index to take torch and torchvision from first (PyTorch's CPU-only index, say: the
# registry's default on Linux is the CUDA build, whose libraries make .venv about 6 GB). Empty: the registry.
TORCH_INDEX ?=
# pyproject.toml's ranges, so that the index's newest is taken only inside them
TORCH_PINS := "$(shell grep -o 'torch>=[^"]*' pyproject.toml | head -1)" \
	"$(shell grep -o 'torchvision>=[^"]*' pyproject.toml | head -1)"

$(STAMP): pyproject.toml | $(PY)
	$(if $(TORCH_INDEX),$(PY) -m pip install -q $(TORCH_PINS) --index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[vision,examples]"
	touch $@

$(DEV_STAMP): pyproject.toml | $(PY)
	$(if $(TORCH_INDEX),$(PY) -m pip install -q $(TORCH_PINS) --index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[vision,examples,dev,data]"
	touch $(STAMP) $@

install: $(STAMP)
dev: $(DEV_STAMP)

train: $(STAMP)
	$(VENV)/bin/polytrain fit --config examples/digits/config.yaml

# The suite runs in PYTEST_WORKERS processes (pytest-xdist); tests that share a fixture wider than one test
# (a module's spawn of gloo ranks, the reliability battery's background jobs) go to one of them together
# (tests/conftest.py). docs/testing.md: the tiers, the timings, how to run a part.
PYTEST_WORKERS ?= 2
PYTEST_ARGS := -q -n $(PYTEST_WORKERS) --dist load --durations=25

test: $(DEV_STAMP)
	@start=$$(date +%s); status=0; $(PY) -m pytest tests $(PYTEST_ARGS) || status=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s, the whole suite on torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	exit $$status

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

# The lowest supported torch runs the files marked torch_api: what a torch release can change (docs/testing.md).
test-torch-min: $(MIN_STAMP)
	@start=$$(date +%s); status=0; $(MIN_PY) -m pytest tests -m torch_api $(PYTEST_ARGS) || status=$$?; \
	echo "make test-torch-min: $$(( $$(date +%s) - start )) s, the torch_api tier on torch $$($(MIN_PY) -c 'import torch; print(torch.__version__)')"; \
	exit $$status

test-fast: $(DEV_STAMP)
	$(PY) -m pytest tests -m "not slow and not reliability" $(PYTEST_ARGS)

# Line coverage of polytrain/ by the suite at both ends, as CI runs it, worker processes and launched jobs
# included (.coveragerc); the data goes to .coverage-data/, the report's last line is the total.
COVERAGE_RUN = COVERAGE_FILE=$(CURDIR)/.coverage-data/.coverage COVERAGE_RCFILE=$(CURDIR)/.coveragerc
coverage: $(DEV_STAMP) $(MIN_STAMP)
	rm -rf .coverage-data && mkdir .coverage-data
	-$(COVERAGE_RUN) $(PY) -m coverage run -m pytest tests $(PYTEST_ARGS)
	-$(COVERAGE_RUN) $(MIN_PY) -m coverage run -m pytest tests -m torch_api $(PYTEST_ARGS)
	$(COVERAGE_RUN) $(PY) -m coverage combine -q
	$(COVERAGE_RUN) $(PY) -m coverage report | tail -n 1

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
	rm -rf $(VENV) $(MIN_VENV) runs .pytest_cache .coverage-data
