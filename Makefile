# The two commands a fresh machine needs: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup model serve test bench soak lint clean gpu-bundle

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

# the suite on two pytest-xdist workers (most of its time is servers waiting on sockets and the
# sim device's modelled steps), then the tests marked serial alone; TEST_WORKERS=0: one process.
# pytest exits 5 when it ran nothing: that fails unless the other phase ran tests
TEST_WORKERS ?= 2
test: model
	@$(PY) -m pytest -n $(TEST_WORKERS) -m "not serial" $(PYTEST_ARGS); a=$$?; \
	$(PY) -m pytest -m serial $(PYTEST_ARGS); b=$$?; \
	if [ $$a -eq 5 ] && [ $$b -eq 5 ]; then exit 5; fi; \
	for rc in $$a $$b; do if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; done

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

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
