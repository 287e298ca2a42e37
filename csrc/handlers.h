// Handler symbols exported to Python as capsules (see module.cc).
#pragma once

#include "mpi_common.h"

#define DL_DECLARE(name) XLA_FFI_DECLARE_HANDLER_SYMBOL(name)

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
