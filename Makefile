# moe-rl: `make demo` and `make test` work on a fresh machine (README).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast test-integration test-studies test-nightly test-studies-changed test-dist test-gpu mutate bench-check lint format clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned, so that no dependency pulls a CUDA build
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/moe-rl demo --out runs/demo

# the tiers by cost (conftest.py): fast = tests/unit + tests/badinput in process (no child
# processes); integration = child processes, torchrun, Slurm, netns, end-to-end runs (tests/integration,
# tests/dist, and the few marked tests of the fast folders), then the newest megatron-core; studies =
# each study's own tests; nightly = the exhaustive loops whose sampled size the integration tier runs
# (the SIGKILL at every write of a checkpoint and an export). Each tier runs on JOBS pytest workers
# (pytest-xdist, one file per worker at a time, one intra-op thread each: conftest.py); JOBS=0 runs
# in this process.
JOBS ?= $(shell nproc)
XDIST = -n $(JOBS) --dist loadfile
PYTEST = $(BIN)/python -m pytest -q --durations=15 $(XDIST)
test: test-fast test-integration test-studies

test-fast: $(STAMP)
	$(PYTEST) -m "not integration" tests/unit tests/badinput

test-integration: $(STAMP)
	$(PYTEST) -m "integration and not nightly" tests
	$(MAKE) test-megatron-newest

test-studies: $(STAMP)
	$(PYTEST) studies

test-nightly: $(STAMP)
	$(PYTEST) -m nightly tests

# the tests of the studies a change touches (tools/changed_studies.py; STUDY_BASE: what it is measured from)
STUDY_BASE ?= main
test-studies-changed: $(STAMP)
	@studies="$$($(BIN)/python -m tools.changed_studies --base $(STUDY_BASE))"; \
	if [ -z "$$studies" ]; then echo "no study changed since $(STUDY_BASE)"; else $(PYTEST) $$studies; fi

test-dist: $(STAMP)
	$(BIN)/python -m pytest -q tests/dist

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu

# planted bugs against the tests (tools/mutate.py): on demand, not in CI; each mutant's test files, the
# fast tier then the integration tier (MUTATE_TIER=fast|integration|all); MUTATE_REV=<commit> for an older one
MUTATE_REV ?= HEAD
MUTATE_TIER ?= all
mutate: $(STAMP)
	$(BIN)/python -m tools.mutate --rev $(MUTATE_REV) --tier $(MUTATE_TIER)

# each performance benchmark rerun against its committed baseline (benchmarks/baselines.yaml); on
# demand, on an idle machine (minutes); BENCH="engine_throughput step_time" for some
BENCH ?=
bench-check: $(STAMP)
	$(BIN)/python -m benchmarks.check $(BENCH)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .venv312 runs .pytest_cache

# -- a lent GPU (docs/gpu_check.md): `make gpu-wheels` here, with network; `make gpu-check` there,
# offline, over its preinstalled torch and Triton (venv with --system-site-packages).
.PHONY: gpu-wheels gpu-check
WHL ?= .whl
GPU_PYTHON ?= python3
GPU_PY_VERSION ?= 3.12
GPU_VENV ?= /tmp/moe-rl-venv-gpu
GPU_CHECK_S ?= 420
GPU_CHECK_ARGS ?=
# the commit the results are named by, where the copy has no .git (the device machine's)
GPU_COMMIT ?=
# on the lent GPUs' image already (KINDS.md): numpy, matplotlib; name them here for a machine without
GPU_WHEELS_EXTRA ?=
# the newest megatron-core the tests cover (pyproject's bound; `make test-megatron-newest`)
GPU_MEGATRON ?= megatron-core==0.19.2
GPU_DOWNLOAD = $(BIN)/python -m pip download -q --only-binary=:all: --python-version $(GPU_PY_VERSION) \
	--implementation cp --abi cp$(subst .,,$(GPU_PY_VERSION)) --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $(WHL)

gpu-wheels: $(STAMP) sglang-wheels
	mkdir -p $(WHL)
	# pyproject's dependencies and build requirements + what the check needs, less torch and
	# triton (the GPU's own), numpy (the image's), tensorboard (optional); megatron-core without
	# its dependencies (torch, numpy, packaging)
	$(BIN)/python -m tools.gpu_check --requirements $(GPU_WHEELS_EXTRA) > $(WHL)/requirements.txt
	$(GPU_DOWNLOAD) -r $(WHL)/requirements.txt
	$(GPU_DOWNLOAD) --no-deps "$(GPU_MEGATRON)"
	# SGLang's files the colocated IPC check's reader imports (tools/gpu_colocated.py), < 1 MiB
	$(BIN)/python -m tools.gpu_colocated --export-sglang $(WHL)/sglang
	du -sh $(WHL)

gpu-check:
	# the lent GPU's python3 is itself a venv (/opt/torch/.venv): a venv made from it sees only its
	# base interpreter's packages, so a .pth adds its site-packages (torch, triton, numpy) after the
	# new venv's own (what is installed here wins)
	test -x $(GPU_VENV)/bin/python || { $(GPU_PYTHON) -m venv --system-site-packages --without-pip $(GPU_VENV) && \
		$(GPU_PYTHON) -c 'import site; print("import site;", *(f"site.addsitedir({p!r});" for p in site.getsitepackages()))' \
		> "$$($(GPU_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gpu_base.pth"; }
	# pip: the base environment's, else bootstrapped from its wheel
	$(GPU_VENV)/bin/python -m pip --version >/dev/null 2>&1 || \
		$(GPU_VENV)/bin/python $$(ls $(WHL)/pip-*.whl | tail -1)/pip install -q --no-index --find-links $(WHL) pip
	$(GPU_VENV)/bin/python -m pip install -q --no-index --find-links $(WHL) -r $(WHL)/requirements.txt
	$(GPU_VENV)/bin/python -m pip install -q --no-index --find-links $(WHL) --no-deps "$(GPU_MEGATRON)"
	$(GPU_VENV)/bin/python -m pip install -q --no-index --find-links $(WHL) --no-deps -e .
	PYTHONUNBUFFERED=1 MOE_RL_COMMIT=$(GPU_COMMIT) timeout -k 15 $(GPU_CHECK_S) $(GPU_VENV)/bin/python -m tools.gpu_check \
		--budget-s $$(( $(GPU_CHECK_S) - 20 )) $(GPU_CHECK_ARGS)

# SGLang's own files for the tests: each version's wheel in .cache/sglang-wheels (where
# tests/sglang_wheels.py reads it: the fast tier's test_serve_text starts no download), and unpacked
# (its Python files only, no dependencies, whatever this Python is) into .sglang/<version>, with
# pybase64, which its deserializer uses, for tests/unit/test_sglang_weight_push.py. The tests skip,
# naming this target, without them.
.PHONY: sglang-wheels
SGLANG_VERSIONS ?= 0.5.11 0.5.23
SGLANG_PYBASE64 ?= pybase64==1.5.1
SGLANG_WHEELS ?= .cache/sglang-wheels
sglang-wheels: $(STAMP)
	@for v in $(SGLANG_VERSIONS); do \
	  ls $(SGLANG_WHEELS)/sglang-$$v-*.whl >/dev/null 2>&1 || { echo "fetching sglang==$$v into $(SGLANG_WHEELS)"; \
	    $(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
	      --platform manylinux_2_34_x86_64 -d $(SGLANG_WHEELS) "sglang==$$v" || exit 1; }; \
	  d=.sglang/$$v; test -f $$d/sglang/srt/weight_sync/tensor_bucket.py && continue; \
	  rm -rf $$d.tmp && mkdir -p $$d.tmp && \
	  $(BIN)/python -m zipfile -e $$(ls $(SGLANG_WHEELS)/sglang-$$v-*.whl | tail -1) $$d.tmp && \
	  $(BIN)/python -m pip install -q --no-deps --target $$d.tmp "$(SGLANG_PYBASE64)" && \
	  rm -rf $$d && mv $$d.tmp $$d || exit 1; \
	done

# -- the newest megatron-core (docs/megatron_cpu.md#install): it declares Python >= 3.12, so it
# gets a venv of its own (`make test` runs 0.16.1, what pip picks on Python 3.11). Torch first and
# pinned as in $(STAMP); on 3.12 that is PyPI's CUDA build of 2.13.0 (runs on CPU; about 1 min to
# install), which pins its own triton, so the dev extras but triton (and ruff). Runs the whole fast
# tier (megatron-core 0.19 changes more than the model: its import swaps torch's storage loader,
# which a weight push pickles, and its checkpoint writer runs in threads; a list of "megatron
# tests" missed both), the integration tests whose code meets megatron-core's writer and optimizer
# ($(MEGATRON_NEWEST_EXTRA)), one EP and one TP+EP multi-process test, then the tiny recipe's
# per-step losses against $(VENV)'s megatron-core (tests/megatron_losses.py).
.PHONY: test-megatron-newest venv-newest
VENV_NEWEST ?= .venv312
# the first Python >= 3.12 that runs (a pyenv shim of an inactive version does not)
PY_NEWEST ?= $(shell for p in python3.12 python3.13 $$(ls -d $$HOME/.pyenv/versions/3.1[2-9]*/bin/python3 2>/dev/null); do \
	$$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
STAMP_NEWEST := $(VENV_NEWEST)/.installed
# the dev extras (pyproject.toml) but triton (torch's CUDA build pins its own) and ruff
NEWEST_DEV ?= $(shell $(PY) -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb")); \
	print(" ".join(repr(x) for x in d["project"]["optional-dependencies"]["dev"] if x.split("=")[0] not in ("triton", "ruff")))')
MEGATRON_NEWEST_EXTRA ?= tests/integration/test_checkpoint_writer.py \
	'tests/dist/test_parallel_equivalence.py::test_layout_matches_single_process[layout0]' \
	'tests/dist/test_hf_parallel.py::test_import_export_at_layout[tp2ep2]'

$(STAMP_NEWEST): pyproject.toml
	@test -n "$(PY_NEWEST)" || { echo "test-megatron-newest needs python3.12 or newer (PY_NEWEST=...)"; exit 1; }
	test -x $(VENV_NEWEST)/bin/python || $(PY_NEWEST) -m venv $(VENV_NEWEST)
	$(VENV_NEWEST)/bin/python -m pip install -q --upgrade pip
	$(VENV_NEWEST)/bin/python -c "import torch" 2>/dev/null || $(VENV_NEWEST)/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(VENV_NEWEST)/bin/python -m pip install -q -e . $(NEWEST_DEV)
	touch $(STAMP_NEWEST)

# its venv alone (.ci/run builds it while the fast tier runs: mostly the download of torch's CUDA build)
venv-newest: $(STAMP_NEWEST)

test-megatron-newest: $(STAMP_NEWEST) $(STAMP)
	$(VENV_NEWEST)/bin/python -c "import megatron.core, sys; print('megatron-core', megatron.core.__version__, 'on Python', sys.version.split()[0])"
	$(VENV_NEWEST)/bin/python -m pytest -q -p no:cacheprovider $(XDIST) -m "not integration" tests/unit tests/badinput
	$(VENV_NEWEST)/bin/python -m pytest -q -p no:cacheprovider $(XDIST) $(MEGATRON_NEWEST_EXTRA)
	$(BIN)/python -m tests.megatron_losses compare $(BIN)/python $(VENV_NEWEST)/bin/python
