#!/usr/bin/env bash
# Suites and measurements on a GPU node with no network (how #19's figures were taken).
#
#   WHEELS=dir bash benchmarks/gpu_node.sh setup        install wheels from dir (the mpich wheel,
#                                                       NetKet and what it needs beyond the node's
#                                                       image), build distlinalg into python3
#   bash benchmarks/gpu_node.sh test LOGDIR RANKS... -- FILES...
#                                                       the suites on the GPU, one mpiexec run per
#                                                       rank count, all rank counts at once (they share
#                                                       the GPU); logs under LOGDIR/n<N>
#   bash benchmarks/gpu_node.sh bench-gpu OUTDIR        collectives vs copy bandwidth (2 ranks), CG on
#                                                       Poisson 2000² vs jax.scipy's cg, the SR step
#   bash benchmarks/gpu_node.sh check OUTDIR            issue 40's GPU checks in one call (< 7 min)
#   bash benchmarks/gpu_node.sh recheck OUTDIR          after `check`'s fixes: its failed tests, and CG and
#                                                       MINRES at 1 and 2 ranks, with CUDA MPS (< 4 min)
#   OMPI=dir bash benchmarks/gpu_node.sh cuda-aware OUTDIR
#                                                       the CUDA-aware transport: distlinalg rebuilt against
#                                                       the Open MPI in dir (see build-ompi), the comm suites
#                                                       and the collectives benchmark with device pointers
#   bash benchmarks/gpu_node.sh build-ompi PREFIX       (here, not on the node: it needs Debian's sources and
#                                                       CUDA's headers) a CUDA-aware Open MPI 4.1 in PREFIX
#   bash benchmarks/gpu_node.sh scaling OUTDIR [RANKS...]
#                                                       CPU-only: Poisson CG per iteration and the SR
#                                                       step at 1 2 4 8 16 ranks
# PYTHON (default python3) must be able to build distlinalg (cmake, nanobind, scikit-build-core).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BIN=$(dirname "$(command -v "$PY")")
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

stage=${1:?stage: setup, test, bench-gpu, check, recheck, cuda-aware, build-ompi or scaling}
shift

# CUDA MPS: the ranks sharing the GPU run in one context, without a context switch at every
# synchronisation (~0.8 ms without it, `check`'s collectives table).
mps_on() {
  if command -v nvidia-cuda-mps-control > /dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY="$1/mps" CUDA_MPS_LOG_DIRECTORY="$1/mps"; mkdir -p "$1/mps"
    nvidia-cuda-mps-control -d && sleep 1
  fi
}
mps_off() {
  if command -v nvidia-cuda-mps-control > /dev/null; then echo quit | nvidia-cuda-mps-control || true; fi
}
case "$stage" in
setup)
  if [ -n "${WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile "$WHEELS"/*.whl
  fi
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PY" -m pip install -q --no-index --no-deps --no-build-isolation \
    -Cbuild-dir=build/gpu-node -e .
  "$PY" -m distlinalg
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  ;;
test)
  logdir=$1; shift
  ranks=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do ranks+=("$1"); shift; done
  shift || true
  # The worlds run at once on one GPU, and each world's ranks split JAX's preallocation only
  # among themselves (distlinalg/_runtime/cuda.py): let every process allocate on demand instead.
  export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
  pids=()
  for n in "${ranks[@]}"; do
    mkdir -p "$logdir/n$n"
    # RUN_MPI_ARGS: more options of tests/run_mpi.py (e.g. --no-compile-cache)
    MPITEST_LOGS="$logdir/n$n" "$PY" tests/run_mpi.py --ranks "$n" --no-serial ${RUN_MPI_ARGS:-} \
      --timeout "${TEST_TIMEOUT:-1500}" -- -q "$@" \
      > "$logdir/n$n.out" 2>&1 &
    pids+=($!)
  done
  status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  for n in "${ranks[@]}"; do echo "=== $n ranks"; tail -n 30 "$logdir/n$n.out"; done
  exit $status
  ;;
bench-gpu)
  out=$1; mkdir -p "$out"
  "$BIN/mpiexec" -n 2 "$PY" benchmarks/bench_gpu.py --max-bytes "${MAX_BYTES:-268435456}" \
    --repeats "${REPEATS:-5}" --seconds "${SECONDS_PER_RUN:-0.2}" --output "$out/gpu_collectives_2.json"
  "$BIN/mpiexec" -n 1 "$PY" benchmarks/bench_krylov.py --n 2000 --iters "${CG_ITERS:-200}" \
    --repeats "${REPEATS:-3}" --converge --contenders distlinalg-cg jax-scipy-cg --json "$out/krylov_gpu_1.json"
  "$BIN/mpiexec" -n 1 "$PY" benchmarks/bench_sr.py --iters "${SR_ITERS:-20}" --json "$out/sr_gpu_1.json"
  cat "$out/sr_gpu_1.json"; echo
  ;;
check)
  # Issue 40, part 2, in one device call of under 8 minutes (after `setup` in the same call):
  # the suites at 1 and 2 ranks and a 4-rank subset (all at once, sharing the GPU), CG and
  # MINRES on Poisson 2000² at 1 and 2 ranks against jax.scipy's cg, the ranks-sharing-a-GPU
  # cost with and without CUDA MPS, and the overlap demonstration on the node's cores.
  out=$1; mkdir -p "$out"
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  suites=(tests/cuda/test_cuda_lowering.py tests/runtime/test_checks.py tests/comm/test_p2p.py tests/solvers/test_solvers.py
          tests/comm/test_nonblocking.py tests/comm/test_collectives.py)
  for n in 1 2; do
    MPITEST_LOGS="$out/suites/n$n" timeout 200 "$PY" tests/run_mpi.py --ranks "$n" --no-serial --timeout 190 \
      -- -q "${suites[@]}" > "$out/suites_n$n.out" 2>&1 &
  done
  MPITEST_LOGS="$out/suites/n4" timeout 200 "$PY" tests/run_mpi.py --ranks 4 --no-serial --timeout 190 \
    -- -q tests/runtime/test_checks.py tests/comm/test_collectives.py > "$out/suites_n4.out" 2>&1 &
  wait || true
  for n in 1 2 4; do echo "=== suites, $n ranks"; tail -n 15 "$out/suites_n$n.out"; done
  for n in 1 2; do
    timeout 75 "$BIN/mpiexec" -n "$n" "$PY" benchmarks/bench_krylov.py --n 2000 --iters 100 --repeats 3 \
      --contenders distlinalg-cg distlinalg-minres jax-scipy-cg --json "$out/krylov_gpu_$n.json" || true
    cat "$out/krylov_gpu_$n.json" 2>/dev/null; echo
  done
  timeout 45 "$BIN/mpiexec" -n 2 "$PY" benchmarks/bench_gpu.py --max-bytes 65536 --repeats 3 --seconds 0.1 \
    --output "$out/gpu_collectives_2_shared.json" || true
  if command -v nvidia-cuda-mps-control > /dev/null; then
    mps_on "$out"
    timeout 45 "$BIN/mpiexec" -n 2 "$PY" benchmarks/bench_gpu.py --max-bytes 65536 --repeats 3 --seconds 0.1 \
      --output "$out/gpu_collectives_2_mps.json" || true
    mps_off
  else
    echo "no nvidia-cuda-mps-control on this node" > "$out/mps.txt"
  fi
  MPIR_CVAR_ASYNC_PROGRESS=1 JAX_PLATFORMS=cpu timeout 60 "$BIN/mpiexec" -n 4 "$PY" benchmarks/bench_overlap.py \
    --grid 1024 > "$out/overlap_4.txt" 2>&1 || true
  tail -n 20 "$out/overlap_4.txt"
  ;;
recheck)
  out=$1; mkdir -p "$out"
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  mps_on "$out"
  # Each rank count by itself: 2 ranks first (the mismatch needs two), then 1.
  for n in 2 1; do
    MPITEST_LOGS="$out/suites/n$n" timeout $((30 * n + 40)) "$PY" tests/run_mpi.py --ranks "$n" --no-serial \
      --timeout $((30 * n + 30)) \
      -- -q -rfE --tb=short tests/runtime/test_checks.py tests/solvers/test_solvers.py \
      -k "mismatch_is_an_error or without_results or failed_program or minres_indefinite or in_place or copies_no_vector" \
      > "$out/recheck_n$n.out" 2>&1 || true
    tail -n 25 "$out/recheck_n$n.out"
  done
  for n in 1 2; do
    timeout 40 "$BIN/mpiexec" -n "$n" "$PY" benchmarks/bench_krylov.py --n 2000 --iters 100 --repeats 3 \
      --contenders distlinalg-cg distlinalg-minres jax-scipy-cg --json "$out/krylov_gpu_mps_$n.json" 2>&1 \
      | grep -v '^ \|^{\|^}' || true
  done
  mps_off
  ;;
cuda-aware)
  out=$1; mkdir -p "$out"
  ompi=${OMPI:?OMPI=dir: a CUDA-aware Open MPI (build-ompi)}
  export PATH="$ompi/bin:$PATH" LD_LIBRARY_PATH="$ompi/lib:${LD_LIBRARY_PATH:-}" OPAL_PREFIX="$ompi" \
    MPI4PY_MPIABI=openmpi MPI4PY_LIBMPI="$ompi/lib/libmpi.so.40" XLA_PYTHON_CLIENT_PREALLOCATE=false
  "$ompi/bin/ompi_info" --parsable --all | grep 'mpi_built_with_cuda_support:value' | tee "$out/ompi_cuda.txt"
  DISTLINALG_MPICC="$ompi/bin/mpicc" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PY" -m pip install -q --no-index \
    --no-deps --no-build-isolation -Cbuild-dir=build/gpu-node-ompi -e .
  launch=("$ompi/bin/mpiexec" --oversubscribe --mca btl self,vader,smcuda -x PATH -x LD_LIBRARY_PATH -x OPAL_PREFIX
          -x MPI4PY_MPIABI -x MPI4PY_LIBMPI -x XLA_PYTHON_CLIENT_PREALLOCATE)
  "${launch[@]}" -n 2 "$PY" -m distlinalg 2>&1 | tee "$out/transport.txt"
  MPIEXEC="${launch[*]}" MPITEST_LOGS="$out/suites/n2" timeout 110 "$PY" tests/run_mpi.py --ranks 2 --no-serial \
    --timeout 100 -- -q -rfE --tb=short tests/comm/test_collectives.py tests/comm/test_p2p.py \
    > "$out/cuda_aware_n2.out" 2>&1 || true
  tail -n 25 "$out/cuda_aware_n2.out"
  timeout 40 "${launch[@]}" -n 2 "$PY" benchmarks/bench_gpu.py --max-bytes 16777216 --repeats 3 --seconds 0.05 \
    --output "$out/gpu_collectives_2_cuda_aware.json" || true
  ;;
build-ompi)
  prefix=${1:?PREFIX}
  cuda=${CUDA_HOME:-/usr/local/cuda}
  work=$(mktemp -d)
  (cd "$work" && apt-get source --download-only -q openmpi > /dev/null && tar xJf openmpi_*.orig.tar.xz)
  (cd "$work"/openmpi-* && ./configure -q --prefix="$prefix" --with-cuda="$cuda" --disable-mpi-fortran --disable-static \
     --with-hwloc=internal --with-libevent=internal --with-pmix=internal --without-ucx --without-verbs --without-ofi \
     --without-psm2 --disable-oshmem && make -s -j"$(nproc)" && make -s install)
  "$prefix/bin/ompi_info" --parsable --all | grep 'mpi_built_with_cuda_support:value'
  ;;
scaling)
  out=$1; shift; mkdir -p "$out"
  ranks=("$@"); [ ${#ranks[@]} -gt 0 ] || ranks=(1 2 4 8 16)
  export JAX_PLATFORMS=cpu
  for n in "${ranks[@]}"; do
    contenders=(distlinalg-cg); [ "$n" = 1 ] && contenders+=(jax-scipy-cg)
    "$BIN/mpiexec" -n "$n" "$PY" benchmarks/bench_krylov.py --n 2000 --iters "${CG_ITERS:-100}" \
      --repeats "${REPEATS:-3}" \
      --contenders "${contenders[@]}" --json "$out/krylov_cpu_$n.json"
    "$BIN/mpiexec" -n "$n" "$PY" benchmarks/bench_sr.py --iters "${SR_ITERS:-20}" --json "$out/sr_cpu_$n.json"
    cat "$out/sr_cpu_$n.json"; echo
  done
  ;;
*)
  echo "unknown stage $stage" >&2; exit 2
  ;;
esac
