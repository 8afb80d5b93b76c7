# pdserve — a newcomer needs two commands: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# The demo model's training corpus: Debian's bible-kjv-text (the King James Bible, public domain).
CORPUS_DIR := .cache/corpus
CORPUS := $(CORPUS_DIR)/bible-kjv-text/usr/lib/bible.data
DEMO_MODEL := models/demo-v32
export TORCH_DEVICE_BACKEND_AUTOLOAD ?= 0
# The sources' bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (as on CI) every process the tests start
# would compile pdserve's modules again (~1 s of CPU each, hundreds of processes a run).
COMPILE = $(PY) -m compileall -q -j 0 shared router prefill_service decode_service bench tests

.PHONY: demo test install lint bench bench-kv-reuse proto clean system-deps corpus demo-model

# System packages: RDMA verbs + rdmacm for Mooncake, prometheus (+ promtool) for the metrics test,
# openssl for `pdserve certs` / `pdserve up --tls`, a C compiler for the CPU kernels
# (shared/model/cpu_kernels.py). Skipped when present or not root.
system-deps:
	@missing=""; \
	ldconfig -p | grep -q libibverbs.so.1 || missing="$$missing libibverbs1"; \
	ldconfig -p | grep -q librdmacm.so.1 || missing="$$missing librdmacm1"; \
	command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	command -v cc >/dev/null || missing="$$missing gcc libc6-dev"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	      || echo "warning: could not install$$missing (the tests that need them will be skipped)"; \
	  else echo "warning: not root; install$$missing"; fi; \
	fi

# uv installs the same wheels pip would (the same resolution here: `pip freeze` equal), faster (a clean clone:
# 81 s; pip 99 s with the corpus), bytecode compiled as pip does. It does not read pip's configuration, so pip's
# package sources and constraints (as pip resolves them: its environment variables over its files, read once a
# line) are handed to it; wherever uv is missing or fails, pip installs instead.
UV_PIP = conf="$$($(PIP) config list 2>/dev/null)"; \
	setting() { printf '%s\n' "$$conf" | sed -n "s/^\(global\|:env:\)\.$$1='\(.*\)'$$/\2/p" | tail -1; }; \
	fl=$$(setting find-links); ix=$$(setting index-url); ei=$$(setting extra-index-url); cs=$$(setting constraint); \
	$(VENV)/bin/uv pip install -q --python $(PY) --index-strategy unsafe-best-match --compile-bytecode \
	  $$(for f in $$fl; do echo --find-links $$f; done) $${ix:+--index-url $$ix} \
	  $$(for u in $$ei; do echo --extra-index-url $$u; done) $$(for c in $$cs; do echo --constraints $$c; done)

$(STAMP): pyproject.toml Makefile
	@$(MAKE) --no-print-directory system-deps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q uv==0.13.9 || echo "note: uv not installed; pip installs the rest"
	# CPU torch first, pinned, so no dependency can pull a CUDA build.
	@echo "installing torch==2.13.0, then .[test] and .[mooncake] (uv, else pip)"
	@$(UV_PIP) torch==2.13.0 || $(PIP) install -q torch==2.13.0
	@$(UV_PIP) -e '.[test]' || $(PIP) install -q -e '.[test]'
	@$(UV_PIP) -e '.[mooncake]' || $(PIP) install -q -e '.[mooncake]' \
	  || echo "warning: Mooncake transfer engine not installed"
	touch $(STAMP)

install: $(STAMP)

# apt-get download + dpkg -x need no root (an empty apt list needs `apt-get update`, done when root);
# shared/loader/train_demo.py reads $(CORPUS) (compressed verses) by default.
corpus: $(CORPUS)

$(CORPUS):
	mkdir -p $(CORPUS_DIR)
	cd $(CORPUS_DIR) && rm -f bible-kjv-text_*.deb && { apt-get download -qq bible-kjv-text=4.38 \
	  || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get download -qq bible-kjv-text=4.38; } \
	  || apt-get download -qq bible-kjv-text; }
	rm -rf $(CORPUS_DIR)/bible-kjv-text
	dpkg -x $(CORPUS_DIR)/bible-kjv-text_*.deb $(CORPUS_DIR)/bible-kjv-text
	dpkg -e $(CORPUS_DIR)/bible-kjv-text_*.deb $(CORPUS_DIR)/bible-kjv-text/DEBIAN

# Retrain the demo model (deterministic; about 19 min on 2 idle cores, FLOP-bound; see README).
demo-model: $(STAMP) corpus
	$(PY) -m shared.demo.train --out $(DEMO_MODEL)

# The corpus is a test input (tests/test_train_demo.py): fetching it is part of the install, and under
# `make test` its tests run or fail, never skip (PDSERVE_REQUIRE_CORPUS).
test: $(STAMP) corpus
	$(COMPILE)
	PDSERVE_REQUIRE_CORPUS=1 $(PY) -m pytest -q --durations=20

demo: $(STAMP)
	$(COMPILE)
	$(PY) -m router.demo --model $(DEMO_MODEL) --max-tokens 64

bench: $(STAMP)
	$(PY) bench/engine_throughput.py

# The Mooncake conversation trace replayed by AIPerf against `pdserve up`, with and without each KV-reuse feature
# (README, "Replaying the Mooncake trace"). AIPerf installs on first use into its own venv outside the repository
# ($$PDSERVE_AIPERF_VENV, default ~/.cache/pdserve/aiperf-peer; never by `make test`). KV_REUSE_ARGS: its flags.
KV_REUSE_ARGS ?=
bench-kv-reuse: $(STAMP)
	$(PY) bench/kv_reuse.py $(KV_REUSE_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) models/tiny-v32 bench/out .pytest_cache
