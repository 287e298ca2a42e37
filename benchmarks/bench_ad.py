"""Cost of reverse-mode AD through collectives: time(grad) / time(forward), jitted.

    mpiexec -n 2 python benchmarks/bench_ad.py [--quick] [--repeats 5] [--json FILE]

Cases (each jitted; the forward pass returns the loss, the gradient is
``jax.grad`` of the same function, seeds 1 on every rank):
  * allreduce loss: L(x) = Σ allreduce(x·x), x of N float64 per rank
    (forward: 1 allreduce; gradient: forward + the transpose, another allreduce)
  * tensor-parallel layer: y = allreduce(x[:, rows_r] @ W_r) with W (D×H) split by
    rows across ranks, L = Σ tanh(y)², gradient with respect to W_r (and x)
Also ``distlinalg.ad.grad`` (the exact gradient of the replicated loss, which
adds an allreduce of the replicated argument's gradient).

Peer: the same functions in one process with plain JAX (no allreduce: the
full x @ W), whose grad/forward ratio is what AD costs without communication;
run on rank 0 while the other ranks wait. Reported: medians over repeats of
the time per call, the ratio grad/forward for each, and distlinalg's ratio
over the peer's (1.0 = communication adds nothing to AD's relative cost).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import _util  # noqa: E402


def per_call(fn, args, comm, target, repeats):
    """Median seconds per call of a jitted fn over `repeats` samples of about `target` seconds."""

    def run(count):
        out = None
        for _ in range(count):
            out = fn(*args)
        jax.block_until_ready(out)

    run(2)
    count = _util.calibrate(run, target, comm)
    return _util.median([_util.timed_once(lambda: run(count), comm) / count for _ in range(repeats)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.2)
    parser.add_argument("--json")
    args = parser.parse_args()

    import distlinalg as dl
    import distlinalg.ad as dad
    from distlinalg.comm import allreduce

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    N = 1 << (16 if args.quick else 20)
    B, D, H = (128, 512, 512) if args.quick else (256, 2048, 1024)
    rng = np.random.default_rng(rank)

    # ---- case 1: allreduce loss
    x = jnp.asarray(rng.standard_normal(N))

    def loss1(x):
        return jnp.sum(allreduce(x * x))

    def loss1_peer(x):
        return jnp.sum(x * x)

    # ---- case 2: tensor-parallel layer, W split by rows
    rows = np.array_split(np.arange(D), size)[rank]
    xin = jnp.asarray(np.random.default_rng(100).standard_normal((B, D)) / np.sqrt(D))  # replicated
    W_full = np.random.default_rng(101).standard_normal((D, H)) / np.sqrt(D)
    W_r = jnp.asarray(W_full[rows])
    lo, hi = int(rows[0]), int(rows[-1]) + 1

    def loss2(W_r, x):
        y = allreduce(x[:, lo:hi] @ W_r)
        return jnp.sum(jnp.tanh(y) ** 2)

    def loss2_peer(W, x):
        return jnp.sum(jnp.tanh(x @ W) ** 2)

    cases = {
        "allreduce loss": dict(
            args=(x,), fwd=jax.jit(loss1), grad=jax.jit(jax.grad(loss1)),
            exact=jax.jit(dad.grad(loss1, sharded=0)),
            peer_args=(x,), peer_fwd=jax.jit(loss1_peer), peer_grad=jax.jit(jax.grad(loss1_peer)),
            shape=f"x: {N} float64 per rank"),
        "tensor-parallel layer": dict(
            args=(W_r, xin), fwd=jax.jit(loss2), grad=jax.jit(jax.grad(loss2, argnums=(0, 1))),
            exact=jax.jit(dad.grad(loss2, argnums=(0, 1), sharded=0)),
            peer_args=(jnp.asarray(W_full), xin), peer_fwd=jax.jit(loss2_peer),
            peer_grad=jax.jit(jax.grad(loss2_peer, argnums=(0, 1))),
            shape=f"x: {B}x{D} replicated, W: {D}x{H} split by rows, gradient wrt (W_r, x)"),
    }
    results = {}
    t0 = time.perf_counter()
    for name, c in cases.items():
        samples = {"forward": [], "grad": [], "dad.grad": []}
        fns = {"forward": c["fwd"], "grad": c["grad"], "dad.grad": c["exact"]}
        counts = {}
        for key, fn in fns.items():  # warm up and calibrate each
            def run(count, fn=fn):
                out = None
                for _ in range(count):
                    out = fn(*c["args"])
                jax.block_until_ready(out)

            run(2)
            counts[key] = (_util.calibrate(run, args.target / 3, comm), run)
        for _ in range(args.repeats):  # interleaved
            for key, (count, run) in counts.items():
                samples[key].append(_util.timed_once(lambda: run(count), comm) / count)
        med = {k: _util.median(v) for k, v in samples.items()}
        peer = None
        if rank == 0:
            pf = per_call(c["peer_fwd"], c["peer_args"], None, args.target / 3, args.repeats)
            pg = per_call(c["peer_grad"], c["peer_args"], None, args.target / 3, args.repeats)
            peer = {"forward": pf, "grad": pg}
        peer = comm.bcast(peer, root=0)
        results[name] = {"shape": c["shape"], "distlinalg": med, "peer": peer,
                         "ratio": med["grad"] / med["forward"],
                         "ratio_exact": med["dad.grad"] / med["forward"],
                         "peer_ratio": peer["grad"] / peer["forward"]}
        if rank == 0:
            r = results[name]
            _util.eprint(f"[ad n={size}] {name}: fwd {med['forward'] * 1e3:.3f} ms, grad {med['grad'] * 1e3:.3f} ms "
                         f"(x{r['ratio']:.2f}); peer x{r['peer_ratio']:.2f}")
    payload = {"bench": "ad", "ranks": size, "quick": args.quick, "results": results, "repeats": args.repeats,
               "seconds": time.perf_counter() - t0, "versions": _util.versions(), "distlinalg_size": dl.size()}
    if rank == 0:
        _util.write_json(args.json, payload)


if __name__ == "__main__":
    main()
