// Handler symbols exported to Python as capsules (see module.cc).
#pragma once

#include "cuda_transport.h"
#include "mpi_common.h"

#if defined(DL_WITH_CUDA)
#define DL_DECLARE(name)                      \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(name);       \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(name##Cuda); \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(name##CudaEmulated)
#else
#define DL_DECLARE(name) XLA_FFI_DECLARE_HANDLER_SYMBOL(name)
#endif

// Every handler: (FFI target name, handler symbol). The one list: the
// declarations below and the registrations in module.cc expand it.
#define DL_FOR_EACH_HANDLER(X)                      \
  X("distlinalg_allreduce", DlAllreduce)            \
  X("distlinalg_reduce", DlReduce)                  \
  X("distlinalg_bcast", DlBcast)                    \
  X("distlinalg_gather", DlGather)                  \
  X("distlinalg_scatter", DlScatter)                \
  X("distlinalg_allgather", DlAllgather)            \
  X("distlinalg_reduce_scatter", DlReduceScatter)   \
  X("distlinalg_alltoall", DlAlltoall)              \
  X("distlinalg_scan", DlScan)                      \
  X("distlinalg_barrier", DlBarrier)                \
  X("distlinalg_send", DlSend)                      \
  X("distlinalg_recv", DlRecv)                      \
  X("distlinalg_sendrecv", DlSendrecv)              \
  X("distlinalg_sendrecv_status", DlSendrecvStatus) \
  X("distlinalg_iallreduce", DlIallreduce)          \
  X("distlinalg_iallgather", DlIallgather)          \
  X("distlinalg_ireduce_scatter", DlIreduceScatter) \
  X("distlinalg_wait", DlWait)                      \
  X("distlinalg_isend", DlIsend)                    \
  X("distlinalg_irecv", DlIrecv)                    \
  X("distlinalg_wait_flag", DlWaitFlag)             \
  X("distlinalg_wait_if", DlWaitIf)                 \
  X("distlinalg_fence", DlFence)

#define DL_DECLARE_ENTRY(name, symbol) DL_DECLARE(symbol);
DL_FOR_EACH_HANDLER(DL_DECLARE_ENTRY)
#undef DL_DECLARE_ENTRY

// Host computation without MPI (csrc/local_dots.cc, csrc/fused_update.cc),
// registered for the CPU only.
XLA_FFI_DECLARE_HANDLER_SYMBOL(DlLocalDots);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DlFusedUpdate);

namespace distlinalg {
// Completes the non-blocking request `key` (if pending) and drops its result:
// for requests never waited for, at interpreter exit. "" or the error.
std::string WaitAndDiscard(int64_t key);
}  // namespace distlinalg
