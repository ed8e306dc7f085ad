# Two entry points, each bootstrapping .venv (Python 3.12) on a fresh machine.
PY312 ?= $(shell PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || command -v python3.12)
VENV := .venv
STAMP := $(VENV)/.installed
MODEL ?= ../shared/models/stories260k

.PHONY: demo test bootstrap

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PY312) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	@touch $(STAMP)

bootstrap: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/jaxinfer generate --model $(MODEL) --max-tokens 200 "Once upon a time"

# Two pytest workers (pytest-xdist): the suite is mostly single-threaded compiles and interpret-mode kernels;
# on the 2-core CI machine it took 14 min against 21.5 in one process (2026-12-02). Work stealing evens out the
# workers' ends (the tensor-parallel tests take 20-100 s each): 16.4-17.4 min against 18.3 with xdist's default
# (three runs and one, 2026-12-05).
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -x -n 2 --dist worksteal tests
