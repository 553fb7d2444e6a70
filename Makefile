# specrag: `make serve` and `make test` work on a fresh machine with nothing done by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1

.PHONY: install test lint serve bench parity clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is installed first and pinned, so pip takes the local CPU build instead of a
# multi-GB CUDA build; everything else comes from the project's own pyproject.toml.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench,ray]'
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
# The docs site, every link and anchor checked (--strict), built into a temporary folder.
	site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir "$$site"; \
		status=$$?; rm -rf "$$site"; exit $$status

test: install lint
	$(PY) -m pytest

serve: install
	$(VENV)/bin/specrag serve

bench: install
	$(VENV)/bin/specrag bench decode

parity: install
	$(PY) -m specrag.evals.checks.parity --dtype float32
	$(PY) -m specrag.evals.checks.parity --dtype bfloat16

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
