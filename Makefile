# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both bootstrap a venv inside the project (torch first, pinned through constraints.txt).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.trainwise-installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: venv system-parts demo test test-all bench ui metrics lint clean

$(STAMP): requirements.txt constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/trainwise demo

# Real servers the integration tests drive (Debian packages): Prometheus, Chromium for the browser
# tests, PostgreSQL for the deployment test. Installed when root and missing; otherwise those tests
# skip with a reason. Never fails the build.
system-parts:
	@missing=""; \
	command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	command -v chromium >/dev/null || missing="$$missing chromium fonts-dejavu-core"; \
	{ command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; } || missing="$$missing postgresql"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    timeout 900 sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing" >/dev/null 2>&1 \
	      || echo "could not install$$missing: their integration tests will skip"; \
	  else echo "not root, not installed:$$missing (their integration tests will skip)"; fi; \
	fi

# Test files run in parallel (pytest-xdist), one file per worker at a time (--dist loadfile:
# a module's shared servers and fixtures stay in one process); one worker more than the cores,
# at most 4 (each worker holds torch, Dagster and its servers): the integration tests spend much
# of their time waiting on servers, daemons and sensor ticks, and the extra worker fills the
# idle core (a clean clone on 2 cores: 997 s of pytest with 2 workers, 802 s with 3, both
# passing). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); n=$$((n + 1)); [ $$n -gt 4 ] && n=4; echo $$n)
XDIST := -n $(TEST_WORKERS) --dist loadfile

test: venv system-parts
	$(PY) -m pytest -q $(XDIST) --durations=25

test-all: venv system-parts
	$(PY) -m pytest -q -m "" $(XDIST)

bench: venv
	$(VENV)/bin/trainwise bench all

ui: venv
	$(VENV)/bin/trainwise ui

# Live training figures for Prometheus/Grafana on 127.0.0.1:9464 (from the telemetry files).
metrics: venv
	$(PY) -m telemetry.prometheus --runs-root $${TRAINWISE_HOME:-.trainwise}/runs --port 9464

lint: venv
	$(VENV)/bin/ruff check .

clean:
	rm -rf .trainwise
