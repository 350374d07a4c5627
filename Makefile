# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.omni-rl-setup

.PHONY: setup test lint demo demo-audio demo-sim demo-vla clean

setup: $(STAMP)

# Re-runs only when pyproject.toml or the Vulkan script changes (or .venv is gone): a
# second `make setup` takes well under a second. tools/setup_vulkan.sh gives SAPIEN a CPU
# Vulkan driver in .vulkan/ on machines without a GPU driver.
$(STAMP): pyproject.toml tools/setup_vulkan.sh
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q -e ".[dev,sim]"
	tools/setup_vulkan.sh
	@touch $(STAMP)

# The import layers of pyproject.toml ([tool.importlinter]) are checked on the package
# tree as it installs, copied to build/lint: grimp finds packages by path, so in the
# editable install it cannot see preprocess/, rewards/ and sim/ as omni_rl.*. (-W: the
# copy's setuptools notices concern the wheel's metadata, which the wheel test builds.)
LINT_TREE := build/lint

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf $(LINT_TREE)
	$(BIN)/python -W ignore::UserWarning setup.py -q build_py --build-lib $(LINT_TREE)
	cd $(LINT_TREE) && PYTHONPATH=$$PWD $(abspath $(BIN))/lint-imports --no-logo --no-cache $(CURDIR)/pyproject.toml

test: setup lint
	OMNI_RL_THREADS=$${OMNI_RL_THREADS:-2} $(BIN)/python -m pytest

demo: setup
	$(BIN)/omni-rl quickstart

# A tiny Qwen2-Audio on synthetic audio QA: SFT, then GRPO (CPU, about 2 minutes).
demo-audio: setup
	$(BIN)/omni-rl quickstart --audio

# A flow policy on ManiSkill PushCube: demos, BC, Flow-Noise PPO (CPU envs; 3 seeds, about 35 minutes).
demo-sim: setup
	$(BIN)/omni-rl quickstart --sim

# A tiny pi_0 reaching the target an instruction names in a camera image: demos, BC, Flow-Noise PPO (3 seeds, about 15 minutes).
demo-vla: setup
	$(BIN)/omni-rl quickstart --vla

clean:
	rm -rf $(VENV) .vulkan runs build dist *.egg-info .pytest_cache .ruff_cache
