# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# torch first and pinned: a CPU wheel (an unpinned torch would pull a multi-GB CUDA build).
TORCH   ?= torch==2.13.0
DS      ?= deepspeed==0.19.8
MPIEXEC := $(BIN)/mpiexec
# Every pytest run has a wall-clock bound, and every test its own (pytest-timeout).
PYTEST  := $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=600

.PHONY: install fixtures test demo bench clean docs

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q $(DS) -e '.[test,plot]'
	touch $(STAMP)

fixtures: install
	# dev/ (the tiny trainer) is the repo's, not installed: the repo root on the path
	PYTHONPATH=$(CURDIR) $(BIN)/python tests/ckpt_fixtures.py
	# the Python 3.10 venv of tests/test_python310.py (core install only; ~20 s once, cached)
	$(BIN)/python tests/test_python310.py

test: fixtures
	$(MAKE) docs
	# tests/test_docs.py takes the site just built rather than building it again
	MPITAILOR_SITE_BUILT=build/site timeout 2400 $(PYTEST) -n 2 tests --durations=15
	timeout 900 $(MPIEXEC) -n 2 $(PYTEST) --with-mpi -m mpi tests
	timeout 900 $(MPIEXEC) -n 3 $(PYTEST) --with-mpi -m mpi tests
	$(MAKE) test-slurm
	$(MAKE) test-cluster

# A real one-node Slurm (installed and started as root; exit 3 = it cannot be set up here,
# and the tests then skip saying why), stopped again whatever the tests did.
.PHONY: test-slurm
test-slurm: install
	rc=0; bash slurm/start-cluster.sh >/dev/null || rc=$$?; \
	if [ $$rc -eq 0 ] || [ $$rc -eq 3 ]; then \
		rc=0; MPITAILOR_SLURM_TESTS=1 timeout 1500 $(PYTEST) tests/test_slurm.py --durations=5 || rc=$$?; \
	fi; \
	bash slurm/stop-cluster.sh; exit $$rc

# A real 3-node Slurm on this host (nodes in their own network, UTS and mount namespaces;
# root; exit 3 = it cannot be set up here, and the tests then skip saying why), stopped again
# whatever the tests did.
.PHONY: test-cluster
test-cluster: install
	rc=0; bash slurm/start-cluster.sh --nodes 3 >/dev/null || rc=$$?; \
	if [ $$rc -eq 0 ] || [ $$rc -eq 3 ]; then \
		rc=0; MPITAILOR_CLUSTER_TESTS=1 timeout 900 $(PYTEST) --timeout=300 tests/test_cluster.py --durations=10 || rc=$$?; \
	fi; \
	bash slurm/stop-cluster.sh --nodes 3; exit $$rc

demo: install
	$(BIN)/python -m dev.demo

# The documentation site (docs/, mkdocs.yml) into build/site/, offline: a broken link, a broken
# anchor or a page left out of the nav fails (mkdocs' strict mode and `validation:` settings).
docs: install
	$(BIN)/mkdocs build --strict

# Benchmarks (minutes; not part of make test): tables on stdout, JSON and PNG in bench/out/.
bench: install
	$(BIN)/python -m bench.save_bench
	$(BIN)/python -m bench.merge_bench

clean:
	rm -rf $(VENV) .cache demo-out build/site

# The GPU check (issue 24, part 4; minutes, not part of make test): on a machine with one CUDA
# GPU, DeepSpeed ZeRO-3 bf16 and ZeRO-2 fp16 training with layer-wise saves, a crash, recover
# and resume, and Lightning's DeepSpeedStrategy saves merged and exported. Without a GPU it
# says so in one line and exits 0. JSON in bench/out/gpu_check.json.
.PHONY: gpu-check
gpu-check: install
	$(BIN)/python -m bench.gpu_check

# Older DeepSpeed releases (issue 26; tens of minutes, not part of make test; run before each
# release): for each, a venv in .compat/, ZeRO stages 1-3 trained, merged, resharded,
# exported and resumed by that release. Table on stdout, JSON in bench/results/compat.json.
.PHONY: test-compat
test-compat: install
	TORCH="$(TORCH)" $(BIN)/python tests/compat/run_compat.py
