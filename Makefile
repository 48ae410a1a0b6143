# hvtrace: the two commands a fresh machine needs are `make demo` and `make test`.
# Both set everything up on first use (.venv, torch CPU, Horovod 0.28.1 with PyTorch + Gloo,
# hvtrace itself) and reuse it afterwards.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hvtrace-setup
NP     ?= 2
PYTEST_ARGS ?=

.PHONY: setup demo demo-cluster test lint unit bench samples clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh hvtrace/record/_hot.c hvtrace/record/_hvdpoll.cpp
	bash scripts/setup.sh
	touch $@

## demo: trace a real 2-rank horovodrun --gloo training of the built-in model, then report on it
demo: setup
	NP=$(NP) bash scripts/demo.sh

## demo-cluster: the same across 2 hosts made of namespaces (root; host 2's clock 7.3 s ahead)
demo-cluster: setup
	bash scripts/demo_cluster.sh

## test: lint, then the whole test suite (unit + real horovodrun integration tests)
test: setup
	$(VENV)/bin/ruff check hvtrace hvtrace_boot setup.py dashboard tests bench
	$(VENV)/bin/ruff format --check hvtrace hvtrace_boot setup.py dashboard tests bench
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(PYTEST_ARGS)

unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check hvtrace hvtrace_boot setup.py dashboard tests bench
	$(VENV)/bin/ruff format --check hvtrace hvtrace_boot setup.py dashboard tests bench
	$(VENV)/bin/lint-imports

bench: setup
	$(PY) bench/format_bench.py
	$(PY) bench/overhead.py

clean:
	rm -rf runs build .pytest_cache
