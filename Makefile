# mpitrain: `make run` trains on Fashion-MNIST with 2 ranks; `make test` runs the whole suite.
# Everything is installed from nothing: a venv, the package and the MPI runtime from PyPI (the
# `mpich` wheel); `make run` installs only that, `make test` adds the test extras. Use a system
# MPI with `make test MPIEXEC=/usr/bin/mpiexec`.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
MPIEXEC ?= $(CURDIR)/$(BIN)/mpiexec
NP ?= 2
# Hard wall-clock limit (seconds) for every mpiexec job, so a broken collective can never hang CI.
MPI_TIMEOUT ?= 600
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed

# Tests: one BLAS/Numba thread per rank so 4 ranks on 2 cores do not oversubscribe.
TEST_ENV := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

.PHONY: venv venv-run run test test-unit test-mpi test-horovod test-cuda-sim test-e2e test-gpu \
	test-cluster venv-openmpi test-openmpi \
	gpu-check bench \
	data lint loc \
	clean

# venv-run: what running needs (the package and the MPI wheel); venv: that plus the test extras.
venv-run: $(RUN_STAMP)

venv: $(STAMP)

$(RUN_STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mpich]'
	touch $@

# The test extra includes torch (pinned: pip takes the CPU wheel) for mpitrain.torch's tests,
# the tensorflow extra (tensorflow-cpu, Keras 3) mpitrain.tensorflow's and mpitrain.keras's.
$(STAMP): $(RUN_STAMP)
	$(PY) -m pip install -q -e '.[test,tensorflow]'
	touch $@

# Fashion-MNIST: nothing if already found (--data-dir/MPITRAIN_DATA_DIR, ~/.cache/mpitrain,
# /usr/share/datasets); else Debian's dataset-fashion-mnist when apt-get and root are available;
# else download from the official source with SHA-256 checks (python -m mpitrain.data fetch).
data: venv-run
	@$(PY) -m mpitrain.data info fashion-mnist 2>/dev/null || \
	{ command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	  { apt-get update -qq || true; } && apt-get install -y -qq dataset-fashion-mnist; } || \
	$(PY) -m mpitrain.data fetch fashion-mnist

run: venv-run data
	timeout -k 10 3600 $(MPIEXEC) -n $(NP) $(PY) -m mpitrain

test: test-unit test-mpi test-horovod test-cuda-sim test-e2e test-cluster test-openmpi

test-unit: venv
	$(TEST_ENV) $(PYTEST) tests/unit

# The MPI suite runs as 1 process (singleton MPI) and under mpiexec -n 2, 3, 4 (oversubscribed).
test-mpi: venv
	$(TEST_ENV) timeout -k 10 $(MPI_TIMEOUT) $(PYTEST) tests/mpi
	for n in 2 3 4; do \
		echo "== mpiexec -n $$n"; \
		$(TEST_ENV) timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) tests/mpi || exit 1; \
	done

# Horovod's own test/parallel/test_torch.py (the copy in tests/horovod_suite/upstream) against
# mpitrain.torch: the whole file in one mpiexec job per N, the tests tests/support/horovod_scope.py lists
# skipped; a failure on any rank aborts its job (docs/pytorch.md, "Horovod's own test suite").
test-horovod: venv
	for n in 1 2 3; do \
		echo "== Horovod's test_torch.py, mpiexec -n $$n"; \
		$(TEST_ENV) MPIEXEC=$(MPIEXEC) $(PY) -m tests.horovod_suite.run --one-job --sizes $$n \
			--timeout $(MPI_TIMEOUT) || exit 1; \
	done

# End-to-end: tests that launch `mpiexec ... python -m mpitrain` themselves (each under a timeout).
test-e2e: venv
	$(TEST_ENV) MPIEXEC=$(MPIEXEC) $(PYTEST) tests/e2e

# Hosts in network namespaces on this machine, a bridge between them and tc shaping its links
# (tests/support/netns_hosts.py, docs/launching.md "Two hosts on one machine"); needs root and
# iproute2, installed here when missing. Without them every test skips with one line. Open MPI
# runs there too (tests/cluster/test_openmpi_hosts.py), from its venv, and Slurm (Debian's
# slurm-wlm and munge, installed here when missing: tests/cluster/test_slurm.py).
test-cluster: venv venv-openmpi
	@command -v ip >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get update -qq || true; } && apt-get install -y -qq iproute2; } || true
	@command -v slurmd >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get update -qq || true; } && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq slurm-wlm munge; } || true
	$(TEST_ENV) MPIEXEC=$(MPIEXEC) timeout -k 10 1200 $(PYTEST) tests/cluster

# Open MPI for real: Debian's openmpi-bin, and mpi4py compiled against it in a venv of its own
# (pip's binary mpi4py and the mpich wheel are MPICH's). Open MPI refuses root and more ranks
# than cores unless told, and boxes help texts around a rank's error line unless quiet
# (docs/launching.md, "Open MPI").
OMPI_VENV := .venv-openmpi
OMPI_PY := $(OMPI_VENV)/bin/python
OMPI_STAMP := $(OMPI_VENV)/.installed
MPIRUN_OPENMPI ?= /usr/bin/mpirun.openmpi
OMPI_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
	OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_orte_execute_quiet=1
venv-openmpi: $(OMPI_STAMP)

$(OMPI_STAMP): setup.py
	@command -v mpicc.openmpi >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get \
		>/dev/null && { apt-get update -qq || true; } && \
		apt-get install -y -qq openmpi-bin libopenmpi-dev; } || \
		echo "no Open MPI here (apt-get install openmpi-bin libopenmpi-dev as root): skipped"
	@if command -v mpicc.openmpi >/dev/null; then set -e; \
		test -x $(OMPI_PY) || $(PYTHON) -m venv $(OMPI_VENV); \
		$(OMPI_PY) -m pip install -q --upgrade pip; \
		MPICC=$$(command -v mpicc.openmpi) $(OMPI_PY) -m pip install -q --no-cache-dir \
			--no-binary mpi4py mpi4py; \
		$(OMPI_PY) -m pip install -q -e . pytest pytest-timeout hypothesis torch==2.13.0; \
		$(OMPI_PY) -c "from mpi4py import MPI; v = MPI.Get_library_version(); \
			assert 'Open MPI' in v, v"; \
		touch $@; fi

# Under Open MPI's mpirun at N = 2, 3: the collective cases, mpitrain.torch, the first-hour
# no-hang tests, the launcher's fault matrix (the cases without hydra's host emulation), and
# what behaves differently from MPICH (tests/e2e/test_openmpi.py).
OMPI_MPI_TESTS := tests/mpi/test_collectives.py tests/mpi/test_allreduce.py \
	tests/mpi/test_errors.py tests/mpi/test_torch_collectives.py tests/mpi/test_torch_optimizer.py
OMPI_E2E_TESTS := tests/e2e/test_first_hour.py tests/e2e/test_torch_first_hour.py \
	tests/e2e/test_abort.py tests/e2e/test_launcher_faults.py tests/e2e/test_openmpi.py
test-openmpi: venv-openmpi
	@if [ ! -f $(OMPI_STAMP) ]; then echo "test-openmpi: no Open MPI venv: skipped"; else \
	set -e; for n in 2 3; do \
		echo "== Open MPI mpirun -np $$n"; \
		$(TEST_ENV) $(OMPI_ENV) timeout -k 10 $(MPI_TIMEOUT) $(MPIRUN_OPENMPI) -np $$n \
			$(OMPI_PY) -m pytest -q -p no:cacheprovider $(OMPI_MPI_TESTS); \
	done; \
	$(TEST_ENV) $(OMPI_ENV) MPIEXEC=$(MPIRUN_OPENMPI) $(OMPI_PY) -m pytest -q \
		-p no:cacheprovider $(OMPI_E2E_TESTS); fi

test-cuda-sim: venv
	$(TEST_ENV) NUMBA_ENABLE_CUDASIM=1 $(PYTEST) tests/cudasim

# Needs a GPU and CuPy (pip install -e '.[cuda12]' or '.[cuda13]'); every test skips cleanly
# without one.
test-gpu: venv
	$(TEST_ENV) timeout -k 10 $(MPI_TIMEOUT) $(PYTEST) -m gpu tests/gpu
	$(TEST_ENV) timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n 2 $(PYTEST) -m gpu tests/gpu

# Everything the GPU needs in one command (tools/gpu_check.py; docs/gpu.md, "GPU check"): one JSON
# report and a log in out/gpu-check. No venv target: a GPU machine may be offline with the GPU
# stack in its python3, so this runs the venv's python if there is one, else $(PYTHON), on
# the source tree. Without a GPU: one line, at once. QUICK=1: about 3 minutes; ARGS: more flags.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	@$(GPU_PYTHON) tools/gpu_check.py $(if $(QUICK),--quick) $(ARGS)

bench: venv
	timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n 2 $(PY) benchmarks/allreduce.py --out out/bench --plot
	$(PY) benchmarks/step.py --model mlp lenet cifar_cnn --batch 64 --torch --out out/bench
	timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n 2 $(PY) benchmarks/allreduce.py --algo ring \
		--max-bytes 64M --json out/bench/allreduce-ring.json
	MPIEXEC="$(MPIEXEC)" $(PY) benchmarks/scaling.py --ranks 1 2 --model mlp lenet --mode weak \
		--steps 60 --repeat 2 --timeout $(MPI_TIMEOUT) --out out/bench \
		--ceiling --markdown out/bench/scaling-weak.md -- --threads 1
	$(PY) benchmarks/perfmodel.py --allreduce out/bench/allreduce.json out/bench/allreduce-ring.json \
		--step out/bench/step.json \
		--scaling out/bench/scaling-weak.json --link 25Gbps,5us --link 100Gbps,2us \
		--out out/bench --markdown out/bench/perfmodel.md
	$(PY) benchmarks/report.py --bench out/bench --out docs/results.md

lint: venv
	$(PY) -m pyflakes --version >/dev/null 2>&1 || $(PY) -m pip install -q pyflakes
	$(PY) -m pyflakes mpitrain kernels benchmarks tools tests

loc:
	@wc -l mpitrain/*.py mpitrain/*/*.py kernels/*.py kernels/*/*.py | sort -n | tail -n 25

clean:
	rm -rf $(VENV) build *.egg-info out
	find . -name __pycache__ -prune -exec rm -rf {} +
