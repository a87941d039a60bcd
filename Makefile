# btnode: `make demo` trains on the bundled corpus and serves text; `make test` runs the suite.
# Both create .venv on first use (torch 2.13.0 CPU wheel, then the project with its test extras).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BTNODE := $(VENV)/bin/btnode
DEMO_DIR ?= runs/demo

.PHONY: venv tools test test-fast demo serve proto bench-quality bench-transport bench-serving bench-async bench-wan bench-judge clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 numpy
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# Real parts the tests drive: Prometheus and promtool (Debian's `prometheus`), systemd-analyze,
# iproute2, Chromium (the page of `btnode api`, headless); and Debian's `wamerican` word list, which `btnode judge` reads for its word rate.
# Installed when missing and apt-get is there (as root); tests that need an absent tool skip and say
# which, and the judge names the fallback list it used.
tools:
	@if ! command -v promtool >/dev/null || ! command -v ip >/dev/null; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "installing prometheus, iproute2 (apt-get)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus iproute2 >/dev/null \
	      || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus iproute2 >/dev/null); \
	  else echo "prometheus/iproute2 missing and cannot be installed here: their tests will skip"; fi; \
	fi
	@if ! command -v chromium >/dev/null; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "installing chromium (apt-get): the test of btnode api's page drives it headless"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null \
	      || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null); \
	  else echo "chromium missing and cannot be installed here: the test of the API's page will skip"; fi; \
	fi
	@if [ ! -f /usr/share/dict/american-english ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "installing wamerican (apt-get): the judge's English word list"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wamerican >/dev/null \
	      || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wamerican >/dev/null); \
	  else echo "wamerican missing and cannot be installed here: btnode judge falls back to the corpus's frequent words"; fi; \
	fi

test: venv tools
	$(VENV)/bin/ruff check btnode cli tests bench lab
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q tests

test-fast: venv
	$(PY) -m pytest -q tests -m "not slow"

# A local swarm (1 aggregator + 3 blocks × 2 replicas, separate processes on loopback) trains on the
# bundled corpus, then the aggregator's newest versions are evaluated and serve text.
demo: venv
	rm -rf $(DEMO_DIR)
	$(BTNODE) swarm --state-dir $(DEMO_DIR) --replicas 2 --rounds 8 --steps-per-round 25
	$(BTNODE) eval --checkpoint $(DEMO_DIR) --windows 64
	@echo "--- one sweep per 16 bytes (K=16; the last stage commits the 16 bytes one by one):"
	$(BTNODE) generate --checkpoint $(DEMO_DIR) --bytes 128 --segment 16 --readout commit "The history of the"
	@echo "--- blockwise speculative, up to 16 bytes per traversal, temperature 1 (block 0 drafts, the pooled blocks keep what they accept; no sweep):"
	$(BTNODE) generate --checkpoint $(DEMO_DIR) --bytes 128 --segment 16 --readout spec --temperature 1 "The history of the"
	@echo "--- one sweep per 16 bytes (K=16, all 16 rows sampled independently: what commit fixes):"
	$(BTNODE) generate --checkpoint $(DEMO_DIR) --bytes 64 --segment 16 --readout pool "The history of the"
	@echo "--- one sweep per byte (K=1):"
	$(BTNODE) generate --checkpoint $(DEMO_DIR) --bytes 128 --segment 1 --readout pool "The history of the"
	@echo "--- serve it as an OpenAI-compatible endpoint, with a page at /, from one process: make serve, then"
	@echo "curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{\"prompt\": \"The history of the\", \"max_tokens\": 64}'"

# The demo's checkpoint (or SERVE_DIR) as an OpenAI-compatible endpoint on 127.0.0.1:8000 until Ctrl-C;
# it prints the URL and a curl line (docs/serving.md, "One process").
SERVE_DIR ?= $(DEMO_DIR)
serve: venv
	$(BTNODE) serve --checkpoint $(SERVE_DIR) --listen 127.0.0.1:8000

proto: venv
	cd proto && ../$(PY) -m grpc_tools.protoc -I. --python_out=.. --grpc_python_out=.. --pyi_out=.. btnode/v2/*.proto

bench-quality: venv
	$(PY) -m bench.quality

bench-transport: venv
	$(PY) -m bench.transport

bench-serving: venv
	$(PY) -m bench.serving

bench-async: venv
	$(PY) -m bench.async

bench-wan: venv
	$(PY) -m bench.wan_train

bench-judge: venv tools
	$(PY) -m bench.judge

clean:
	rm -rf $(VENV) runs .pytest_cache
