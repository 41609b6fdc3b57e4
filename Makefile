# The two commands a user needs: `make demo` and `make test`.
# Each creates .venv on first use and installs what it needs; running them again installs nothing.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
TORCH  := torch==2.13.0
# Debian packages the sandbox and tests use; installed with apt-get where missing. The sandbox runs
# untrusted code with Debian's own python3 and pytest (never the project's .venv).
DEBS   := bubblewrap python3-pytest

.PHONY: demo test test-all system-deps clean

demo: $(VENV)/.runtime system-deps
	$(VENV)/bin/rtrl demo

# Two pytest-xdist workers: much of the suite waits (servers, subprocesses, sandboxes, timeouts), so two share
# two cores well (BENCHMARKS.md, "suite"); tests never share a port, a schema or a directory. Work stealing: a
# worker that runs out takes the other's queued tests instead of idling while it works through its long tail.
XDIST  := -n 2 --dist worksteal

test: $(VENV)/.dev system-deps
	$(PY) -m pytest -q $(XDIST)

# GPU tests too (needs CUDA).
test-all: $(VENV)/.dev system-deps
	$(PY) -m pytest -q $(XDIST) -m ''

$(VENV)/bin/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "realtime-rl needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)

# torch first and pinned, so nothing later resolves an unpinned (multi-GB CUDA) build.
$(VENV)/.runtime: pyproject.toml | $(VENV)/bin/python
	$(PIP) install $(TORCH)
	$(PIP) install -e .
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.runtime
	$(PIP) install $(TORCH) -e '.[dev,ray,postgres]'
	touch $@

system-deps:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	  else echo "warning: cannot install$$missing (not root, no passwordless sudo); sandbox tests will skip" >&2; exit 0; fi; \
	  echo "installing Debian packages:$$missing"; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
