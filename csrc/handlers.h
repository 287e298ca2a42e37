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
#define DL_FOR_EACH_HANDLER(X)                    \
  X("distlinalg_allreduce", DlAllreduce)          \
  X("distlinalg_reduce", DlReduce)                \
  X("distlinalg_bcast", DlBcast)                  \
  X("distlinalg_gather", DlGather)                \
  X("distlinalg_scatter", DlScatter)              \
  X("distlinalg_allgather", DlAllgather)          \
  X("distlinalg_reduce_scatter", DlReduceScatter) \
  X("distlinalg_alltoall", DlAlltoall)            \
  X("distlinalg_scan", DlScan)                    \
  X("distlinalg_barrier", DlBarrier)              \
  X("distlinalg_send", DlSend)                    \
  X("distlinalg_recv", DlRecv)                    \
  X("distlinalg_sendrecv", DlSendrecv)            \
  X("distlinalg_sendrecv_status", DlSendrecvStatus)

#define DL_DECLARE_ENTRY(name, symbol) DL_DECLARE(symbol);
DL_FOR_EACH_HANDLER(DL_DECLARE_ENTRY)
#undef DL_DECLARE_ENTRY
