# btnode: `make demo` trains on the bundled corpus and serves text; `make test` runs the suite.
# Both create .venv on first use (torch 2.13.0 CPU wheel, then the project with its test extras).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BTNODE := $(VENV)/bin/btnode
DEMO_DIR ?= runs/demo

.PHONY: venv test test-fast demo bench-quality lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 numpy
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q tests

test-fast: venv
	$(PY) -m pytest -q tests -m "not slow"

demo: venv
	$(BTNODE) train-local --out $(DEMO_DIR) --steps 300 --warmup 30 --log-every 50
	$(BTNODE) eval --checkpoint $(DEMO_DIR) --windows 64
	$(BTNODE) generate --checkpoint $(DEMO_DIR) --bytes 128 --segment 16 "The history of the"

bench-quality: venv
	$(PY) bench/quality.py

clean:
	rm -rf $(VENV) runs .pytest_cache
