"""Local compute kernels: FFI-backed primitives that run on this rank's data, without MPI.

``local_dots`` (inner products of several vector pairs in one pass) and
``fused_update`` (a Krylov step's vector updates with the inner products of
their results, in one pass) are the solvers' vector work on the CPU, each an
XLA FFI handler (csrc/local_dots.cc, csrc/fused_update.cc) with a jnp
lowering elsewhere. They hold no solver logic: the Krylov methods reach them
through ``distlinalg.solvers._vectors`` (``local_vdots``, ``update_and_dots``),
which also decides which vectors are large enough to take them.
"""
