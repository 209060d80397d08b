# The two set-up commands of the README: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: test demo lint bench clean

$(VENV)/.stamp-core: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: on these machines pip then takes the local CPU wheel
	# instead of downloading a multi-GB CUDA build to satisfy `torch>=2.1`.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $@

test: $(VENV)/.stamp-core
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m pytest

demo: $(VENV)/.stamp-core
	$(PY) -m kvtier.demo

lint: $(VENV)/.stamp-core
	$(PY) -m ruff check src tests benchmarks

bench: $(VENV)/.stamp-core
	$(PY) benchmarks/bench_manager.py --quick

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
