# hvtrace: the two commands a fresh machine needs are `make demo` and `make test`.
# Both set everything up on first use (.venv, torch CPU, Horovod 0.28.1 with PyTorch + Gloo,
# hvtrace itself) and reuse it afterwards.

VENV   ?= .venv
PY     := $(VENV)/bin/python
# HOROVOD_WITH_MPI=1 (e.g. `HOROVOD_WITH_MPI=1 make setup`) builds Horovod with Open MPI too
# (mpirun, horovodrun --mpi); its own stamp, so that asking for it later rebuilds.
STAMP  := $(VENV)/.hvtrace-setup$(if $(filter 1,$(HOROVOD_WITH_MPI)),-mpi,)
NP     ?= 2
PYTEST_ARGS ?=
# pytest-xdist workers for the unit tests (`make test`, `make unit`); 0 runs them in one process
UNIT_WORKERS ?= 2
# The unit tests: in UNIT_WORKERS processes, then those marked `timing` alone (they measure CPU
# time: no other test may run beside them; tests/conftest.py). UNIT_SELECT: `make unit` leaves
# out the slow ones (--quick: tests/unit/slow_tests.txt, written by scripts/slow_tests.py).
# The timing phase collects only the files that mark such tests (collecting all of tests/unit
# costs about 15 s).
UNIT_SELECT ?=
TIMING_FILES := $(or $(shell grep -l 'pytest.mark.timing' tests/unit/*.py),tests/unit)
UNIT_RUN = u=0; t=0; \
	$(PY) -m pytest tests/unit -n $(UNIT_WORKERS) --timing-tests=skip $(UNIT_SELECT) $(PYTEST_ARGS) || u=$$?; \
	$(PY) -m pytest $(TIMING_FILES) --timing-tests=only $(UNIT_SELECT) $(PYTEST_ARGS) || t=$$?
# Each pytest phase runs whatever the others' results; its exit status 5 (PYTEST_ARGS selected no
# test in it) fails only when no phase ran a test.
PHASES_OK = for rc in $$u $$t $$i; do [ $$rc = 0 ] || [ $$rc = 5 ] || exit $$rc; done; \
	case "$$u$$t$$i" in *0*) ;; *) exit 5 ;; esac

.PHONY: setup demo demo-cluster test test-busy lint unit docs bench samples clean

setup: $(STAMP)
	@# The tree's bytecode, written where missing or stale. Environments that set
	@# PYTHONDONTWRITEBYTECODE=1 (this machine's does) never cache it otherwise, and every process
	@# that imports hvtrace (each rank, each `hvtrace analyze`) compiled its sources anew: 0.3-0.4 s
	@# of CPU a process on this machine when idle, more under load (bench/bytecode.py).
	$(PY) -m compileall -q hvtrace hvtrace_boot dashboard tests bench

# the compiled hot path: hvtrace/record/_hot.c and the parts it includes (hvtrace/record/_hot/)
$(STAMP): pyproject.toml scripts/setup.sh hvtrace/record/_hot.c $(wildcard hvtrace/record/_hot/*.[ch]) \
    hvtrace/record/_hvdpoll.cpp
	bash scripts/setup.sh
	touch $@

## demo: trace a real 2-rank horovodrun --gloo training of the built-in model, then report on it
demo: setup
	NP=$(NP) bash scripts/demo.sh

## demo-cluster: the same across 2 hosts made of namespaces (root; host 2's clock 7.3 s ahead)
demo-cluster: setup
	bash scripts/demo_cluster.sh

## test: lint, the documentation built strictly, then the whole test suite: the unit tests
## (UNIT_RUN: in UNIT_WORKERS processes, then those marked timing), then the real horovodrun
## integration tests one at a time (their timing assertions need the cores to themselves)
test: setup
	$(VENV)/bin/ruff check hvtrace hvtrace_boot setup.py dashboard tests bench scripts
	$(VENV)/bin/ruff format --check hvtrace hvtrace_boot setup.py dashboard tests bench scripts
	$(VENV)/bin/lint-imports
	$(MAKE) docs
ifneq ($(filter tests/%,$(PYTEST_ARGS)),)
	@# PYTEST_ARGS names its tests (tests/...): those, in one process
	$(PY) -m pytest $(PYTEST_ARGS)
else
	$(UNIT_RUN); \
	i=0; $(PY) -m pytest tests/integration $(PYTEST_ARGS) || i=$$?; \
	$(PHASES_OK)
endif

## test-busy: the integration tests with a busy neighbour (a process keeping one core busy the
## whole time): what a timing-dependent test must also pass
test-busy: setup
	$(PY) -m pytest tests/integration --busy-neighbour $(PYTEST_ARGS)

## unit: the quick loop while changing code: the unit tests but the slow ones (make test runs all)
unit: UNIT_SELECT = --quick
unit: setup
	$(UNIT_RUN); $(PHASES_OK)

lint: setup
	$(VENV)/bin/ruff check hvtrace hvtrace_boot setup.py dashboard tests bench scripts
	$(VENV)/bin/ruff format --check hvtrace hvtrace_boot setup.py dashboard tests bench scripts
	$(VENV)/bin/lint-imports

## docs: the documentation site, built strictly into site/ (a broken link or anchor, a missing
## page or a docstring mkdocstrings cannot render fails); its reference pages come from the code
docs: setup
	@# not --quiet: it hides the warnings that --strict counts
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(VENV)/bin/mkdocs build --strict

bench: setup
	$(PY) bench/format_bench.py
	$(PY) bench/overhead.py

clean:
	rm -rf runs build site .pytest_cache
