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

DL_DECLARE(DlAllreduce);
DL_DECLARE(DlReduce);
DL_DECLARE(DlBcast);
DL_DECLARE(DlGather);
DL_DECLARE(DlScatter);
DL_DECLARE(DlAllgather);
DL_DECLARE(DlReduceScatter);
DL_DECLARE(DlAlltoall);
DL_DECLARE(DlScan);
DL_DECLARE(DlBarrier);
DL_DECLARE(DlSend);
DL_DECLARE(DlRecv);
DL_DECLARE(DlSendrecv);
