# pdserve — a newcomer needs two commands: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
export TORCH_DEVICE_BACKEND_AUTOLOAD ?= 0

.PHONY: demo test install lint bench proto clean system-deps

# System packages: RDMA verbs + rdmacm for Mooncake, prometheus (+ promtool) for the metrics test,
# openssl for `pdserve certs` / `pdserve up --tls`. Skipped when present or not root.
system-deps:
	@missing=""; \
	ldconfig -p | grep -q libibverbs.so.1 || missing="$$missing libibverbs1"; \
	ldconfig -p | grep -q librdmacm.so.1 || missing="$$missing librdmacm1"; \
	command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	      || echo "warning: could not install$$missing (the tests that need them will be skipped)"; \
	  else echo "warning: not root; install$$missing"; fi; \
	fi

$(STAMP): pyproject.toml Makefile
	@$(MAKE) --no-print-directory system-deps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first, pinned, so no dependency can pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q -e '.[mooncake]' || echo "warning: Mooncake transfer engine not installed"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m router.demo

bench: $(STAMP)
	$(PY) bench/engine_throughput.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) models bench/out .pytest_cache
