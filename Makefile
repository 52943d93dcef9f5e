# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both bootstrap a venv inside the project (torch first, pinned through constraints.txt).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.trainwise-installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: venv demo test test-all bench ui metrics lint clean

$(STAMP): requirements.txt constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/trainwise demo

test: venv
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && timeout 600 sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus' >/dev/null 2>&1 || echo "prometheus not installed: its integration test will skip"; }
	$(PY) -m pytest -q

test-all: venv
	$(PY) -m pytest -q -m ""

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
