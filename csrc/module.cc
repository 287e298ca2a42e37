// The distlinalg._native extension: FFI handler capsules, build facts and the
// runtime switches of the handlers.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "handlers.h"

namespace nb = nanobind;
namespace dl = distlinalg;

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

std::string Implementation() {
#if defined(MPICH_VERSION)
  return "MPICH";
#elif defined(OPEN_MPI)
  return "Open MPI";
#else
  return "unknown";
#endif
}

std::string HeaderVersion() {
#if defined(MPICH_VERSION)
  return MPICH_VERSION;
#elif defined(OMPI_MAJOR_VERSION)
  return std::to_string(OMPI_MAJOR_VERSION) + "." +
         std::to_string(OMPI_MINOR_VERSION) + "." +
         std::to_string(OMPI_RELEASE_VERSION);
#else
  return "unknown";
#endif
}

std::string RuntimeLibraryVersion() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(buf, &len);
  return std::string(buf, len);
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "Native MPI handlers of distlinalg (XLA FFI).";

  m.def("registrations", [] {
    nb::dict d;
    d["distlinalg_allreduce"] = Capsule(DlAllreduce);
    d["distlinalg_reduce"] = Capsule(DlReduce);
    d["distlinalg_bcast"] = Capsule(DlBcast);
    d["distlinalg_gather"] = Capsule(DlGather);
    d["distlinalg_scatter"] = Capsule(DlScatter);
    d["distlinalg_allgather"] = Capsule(DlAllgather);
    d["distlinalg_reduce_scatter"] = Capsule(DlReduceScatter);
    d["distlinalg_alltoall"] = Capsule(DlAlltoall);
    d["distlinalg_scan"] = Capsule(DlScan);
    d["distlinalg_barrier"] = Capsule(DlBarrier);
    d["distlinalg_send"] = Capsule(DlSend);
    d["distlinalg_recv"] = Capsule(DlRecv);
    d["distlinalg_sendrecv"] = Capsule(DlSendrecv);
    return d;
  });

  m.def("build_info", [] {
    nb::dict d;
    d["implementation"] = Implementation();
    d["header_version"] = HeaderVersion();
    d["mpi_standard"] = std::to_string(MPI_VERSION) + "." +
                        std::to_string(MPI_SUBVERSION);
    d["comm_world_handle"] = dl::HandleFromComm(MPI_COMM_WORLD);
    d["comm_null_handle"] = dl::HandleFromComm(MPI_COMM_NULL);
    d["cuda"] = false;
    return d;
  });
  m.def("runtime_library_version", &RuntimeLibraryVersion,
        "MPI_Get_library_version of the libmpi this extension calls.");
  m.def("proc_null", [] { return static_cast<int>(MPI_PROC_NULL); });

  m.def(
      "configure",
      [](bool debug_log, bool check_signatures, bool serialize,
         int64_t max_count) {
        auto& s = dl::GlobalSettings();
        s.debug_log = debug_log;
        s.check_signatures = check_signatures;
        s.serialize = serialize;
        s.max_count = max_count;
      },
      nb::arg("debug_log"), nb::arg("check_signatures"), nb::arg("serialize"),
      nb::arg("max_count"),
      "Set the handlers' switches (see distlinalg._mpi.configure).");
  m.def("settings", [] {
    const auto& s = dl::GlobalSettings();
    nb::dict d;
    d["debug_log"] = s.debug_log;
    d["check_signatures"] = s.check_signatures;
    d["serialize"] = s.serialize;
    d["max_count"] = s.max_count;
    return d;
  });
}
