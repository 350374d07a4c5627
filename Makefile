# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.omni-rl-setup

.PHONY: setup test lint demo clean

setup: $(STAMP)

# Re-runs only when pyproject.toml changes (or .venv is gone): a second `make setup`
# takes well under a second.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: setup lint
	OMNI_RL_THREADS=$${OMNI_RL_THREADS:-2} $(BIN)/python -m pytest

demo: setup
	$(BIN)/omni-rl quickstart

clean:
	rm -rf $(VENV) runs build dist *.egg-info .pytest_cache .ruff_cache
