// The ScaLAPACK engine (csrc/scalapack.cc): handlers and the run-time loader.
// Nothing here needs MKL at build time.
#pragma once

#include <string>
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
}  // namespace scalapack
}  // namespace distlinalg
