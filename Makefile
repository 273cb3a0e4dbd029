# The two commands a fresh machine needs: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup model serve test test-random fairness-http bench soak lint clean gpu-bundle llama-server

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build; an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	# the rest within the tested versions (constraints.txt)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,bench]'
	touch $@

setup: $(VENV)/.installed

model: setup
	@$(PY) -m gapless.common.model_cache >/dev/null

serve: model
	$(VENV)/bin/gapless serve $(ARGS)

# the suite on two pytest-xdist workers (tests/suite.sh); TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2
test: model
	bash tests/suite.sh $(PY) $(TEST_WORKERS) $(PYTEST_ARGS)

# the same suite with its modules and tests in a random order (pytest-randomly; the seed it used
# is printed at the top): SEED=N repeats an order
SEED ?=
test-random: model
	bash tests/suite.sh $(PY) $(TEST_WORKERS) -p randomly $(if $(SEED),--randomly-seed=$(SEED)) $(PYTEST_ARGS)

# tenant fairness measured over HTTP from the client's side, alone on a quiet machine (the
# scheduler's fairness is in `make test`, in process)
fairness-http: model
	$(PY) -m pytest -m serial $(PYTEST_ARGS)

bench: model
	$(PY) -m pytest tests -k bench --benchmark-enable --benchmark-only $(PYTEST_ARGS)

# a long run near capacity with cancellations on sim, then a killed role (bench/soak.py);
# SOAK_ARGS='--duration 300' for a shorter one
SOAK_ARGS ?=
soak: model
	$(PY) -m gapless.bench.soak $(SOAK_ARGS)

# the offline GPU check's bundle, .gpu-bundle/ (README, "On a GPU"); needs the package index.
# PREPARE_ARGS='--python 3.11' or '--host-freeze FILE' for a host other than the GPU image
PREPARE_ARGS ?=
gpu-bundle: model
	$(PY) -m gapless.bench.gpu_check prepare $(PREPARE_ARGS)

# llama.cpp's server for the comparison benches (bench/build_llama_server.sh); prints its path
llama-server:
	bash bench/build_llama_server.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
