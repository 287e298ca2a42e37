// The ScaLAPACK engine (csrc/scalapack.cc): handlers and the run-time loader.
// Nothing here needs MKL at build time.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mpi_common.h"

// Solve A X = B (attribute kind: 0 Cholesky, 1 LU) and the Hermitian
// eigendecomposition, on a matrix held by rows.
XLA_FFI_DECLARE_HANDLER_SYMBOL(DlScalapackSolve);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DlScalapackEigh);

namespace distlinalg {
namespace scalapack {
// dlopens `paths` in order (RTLD_LAZY | RTLD_GLOBAL, after making the MPI
// library global) and binds the BLACS and ScaLAPACK routines: "" on success
// (also when already loaded), else why not.
std::string Load(const std::vector<std::string>& paths);
bool Loaded();
// The handlers' own buffers (block-cyclic pieces, workspaces, exchange
// panels), in bytes: (live, high-water); `reset_peak` restarts the
// high-water mark from the live bytes after reading it.
std::pair<int64_t, int64_t> Memory(bool reset_peak);
}  // namespace scalapack
}  // namespace distlinalg
