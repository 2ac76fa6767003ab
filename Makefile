# Two commands do everything on a fresh machine:
#   make demo   a whole federation on 127.0.0.1 (coordinator + 3 contributors, 3 rounds)
#   make test   the test suite
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-all lint proto bench

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/gym-sim demo

test: $(VENV)/.installed
	$(PY) -m pytest

test-all: $(VENV)/.installed
	$(PY) -m pytest -m "" 

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check zoo_gym tests bench
	$(VENV)/bin/ruff format --check zoo_gym tests bench
	$(VENV)/bin/mypy zoo_gym
	$(VENV)/bin/lint-imports

proto: $(VENV)/.installed
	$(PY) proto/generate.py
