// The distlinalg._native extension: FFI handler capsules, build facts and the
// runtime switches of the handlers.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>

#include "checks.h"

#include "handlers.h"
#include "scalapack.h"

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

// Target name -> handler, for one variant ("cpu", "cuda", "cuda_emulated").
#if defined(DL_WITH_CUDA)
#define DL_VARIANT(symbol, variant)                             \
  (variant == "cuda"            ? Capsule(symbol##Cuda)         \
   : variant == "cuda_emulated" ? Capsule(symbol##CudaEmulated) \
                                : Capsule(symbol))
#else
#define DL_VARIANT(symbol, variant) Capsule(symbol)
#endif

// DL_FOR_EACH_HANDLER (handlers.h) lists every handler.

nb::dict Registrations(const std::string& variant) {
  nb::dict d;
#define DL_REGISTER(name, symbol) d[name] = DL_VARIANT(symbol, variant);
  DL_FOR_EACH_HANDLER(DL_REGISTER)
#undef DL_REGISTER
  // Computation without MPI, on the host only (the solvers' local dots and
  // fused vector updates).
  if (variant != "cuda") {
    d["distlinalg_local_dots"] = Capsule(DlLocalDots);
    d["distlinalg_fused_update"] = Capsule(DlFusedUpdate);
    // ScaLAPACK on host buffers (csrc/scalapack.cc); MKL is loaded at run
    // time (scalapack_load), a call before that is an error.
    d["distlinalg_scalapack_solve"] = Capsule(DlScalapackSolve);
    d["distlinalg_scalapack_eigh"] = Capsule(DlScalapackEigh);
  }
  return d;
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "Native MPI handlers of distlinalg (XLA FFI).";

  m.def(
      "registrations",
      [](const std::string& variant) {
#if defined(DL_WITH_CUDA)
        const bool known =
            variant == "cpu" || variant == "cuda" || variant == "cuda_emulated";
#else
        const bool known = variant == "cpu";
#endif
        if (!known) {
          throw nb::value_error(("distlinalg: no handlers for variant '" +
                                 variant + "' in this build")
                                    .c_str());
        }
        return Registrations(variant);
      },
      nb::arg("variant") = "cpu",
      "FFI target name -> handler capsule. variant: 'cpu', or in CUDA builds "
      "'cuda' (XLA's CUDA stream) and 'cuda_emulated' (the CUDA code path "
      "registered on the CPU, for tests with a stand-in driver).");

  m.def(
      "scalapack_load",
      [](const std::vector<std::string>& paths) {
        return dl::scalapack::Load(paths);
      },
      nb::arg("paths"),
      "dlopen MKL's ScaLAPACK libraries `paths` in order and bind its "
      "routines: '' or why not.");
  m.def("scalapack_loaded", &dl::scalapack::Loaded);
  m.def("scalapack_memory", &dl::scalapack::Memory,
        nb::arg("reset_peak") = false,
        "Bytes the ScaLAPACK handlers hold themselves beside XLA's buffers: "
        "(live, high-water) of this process; reset_peak restarts the "
        "high-water mark.");

  m.def("wait_discard", &dl::WaitAndDiscard, nb::arg("key"),
        "Completes a pending non-blocking request and drops its result ('' or "
        "the error).");

  m.def(
      "mpi_cuda_support",
      [] {
        dl::MpiCudaSupport s = dl::QueryMpiCudaSupport();
        nb::dict d;
        d["supported"] = s.supported;
        d["method"] = s.method;
        return d;
      },
      "Whether the MPI library reports CUDA-aware support (1, 0, or -1 "
      "unknown).");

#if defined(DL_WITH_CUDA)
  m.def("cuda_driver_status", &dl::cuda::DriverStatus,
        "Loads the CUDA driver if needed: '' when usable, else the reason.");
  m.def(
      "set_cuda_transport",
      [](bool cuda_aware) {
        dl::cuda::SetTransport(cuda_aware ? dl::cuda::Transport::kCudaAware
                                          : dl::cuda::Transport::kHostStaged);
      },
      nb::arg("cuda_aware"),
      "Device pointers straight to MPI (True) or host staging (False).");
  m.def("set_cuda_staging_chunk", &dl::cuda::SetStagingChunkBytes,
        nb::arg("bytes"),
        "Host staging: buffers larger than this many bytes go through two "
        "pinned blocks of this size, in chunks.");
  m.def("cuda_staging_chunk", &dl::cuda::StagingChunkBytes);
  m.def("cuda_transport", [] {
    return dl::cuda::CurrentTransport() == dl::cuda::Transport::kCudaAware
               ? "cuda-aware"
               : "host-staged";
  });
#endif

  m.def("build_info", [] {
    nb::dict d;
    d["implementation"] = Implementation();
    d["header_version"] = HeaderVersion();
    d["mpi_standard"] =
        std::to_string(MPI_VERSION) + "." + std::to_string(MPI_SUBVERSION);
    d["comm_world_handle"] = dl::HandleFromComm(MPI_COMM_WORLD);
    d["comm_null_handle"] = dl::HandleFromComm(MPI_COMM_NULL);
#if defined(DL_WITH_CUDA)
    d["cuda"] = true;
#else
    d["cuda"] = false;
#endif
    return d;
  });
  m.def("runtime_library_version", &RuntimeLibraryVersion,
        "MPI_Get_library_version of the libmpi this extension calls.");
  m.def("proc_null", [] { return static_cast<int>(MPI_PROC_NULL); });

  m.def(
      "configure",
      [](bool debug_log, int check_mode, bool serialize, int64_t max_count) {
        if (check_mode < 0 || check_mode > 2) {
          throw nb::value_error("distlinalg: check_mode must be 0, 1 or 2");
        }
        auto& s = dl::GlobalSettings();
        s.debug_log = debug_log;
        s.check_mode = check_mode;
        s.serialize = serialize;
        s.max_count = max_count;
      },
      nb::arg("debug_log"), nb::arg("check_mode"), nb::arg("serialize"),
      nb::arg("max_count"),
      "Set the handlers' switches (see distlinalg._mpi.configure). check_mode: "
      "0 off, 1 first run of each call site (default), 2 every call.");
  m.def(
      "set_cancellable_collectives",
      [](bool on) { dl::GlobalSettings().cancellable_collectives = on; },
      nb::arg("on"),
      "Collectives as nonblocking MPI calls polled cancellably (True), or "
      "MPI's blocking calls.");
  m.def(
      "set_idle_sleep", [](bool on) { dl::GlobalSettings().idle_sleep = on; },
      nb::arg("on"),
      "Waits that outlast their spinning and yielding polls sleep between "
      "polls (True: ranks share cores), or keep yielding.");
  m.def("settings", [] {
    const auto& s = dl::GlobalSettings();
    nb::dict d;
    d["cancellable_collectives"] = s.cancellable_collectives;
    d["idle_sleep"] = s.idle_sleep;
    d["debug_log"] = s.debug_log;
    d["check_mode"] = s.check_mode;
    d["check_signatures"] = s.check_mode == 2;
    d["serialize"] = s.serialize;
    d["max_count"] = s.max_count;
    return d;
  });

  m.def(
      "current_calls",
      [] {
        nb::list calls;
        const auto now = std::chrono::steady_clock::now();
        for (const dl::ActiveCall& c : dl::CurrentCalls()) {
          nb::dict d;
          d["op"] = std::string(c.op);
          d["dtype"] = std::string(c.dtype == xla::ffi::DataType::TOKEN
                                       ? "-"
                                       : dl::DtypeName(c.dtype));
          d["count"] = c.count;
          d["root"] = c.root;
          d["comm"] = c.comm;
          d["rank"] = c.rank;
          d["phase"] = std::string(c.phase == dl::Phase::kChecking ? "checking"
                                                                   : "running");
          d["checked"] = c.checked;
          d["seconds"] = std::chrono::duration<double>(now - c.start).count();
          d["seq"] = c.seq;
          calls.append(d);
        }
        return calls;
      },
      "The distlinalg MPI calls in progress on this process: a list of dicts "
      "(op, dtype, count, root (peer for point-to-point; -1 none), comm, "
      "rank, seconds since the call started, seq).");
  m.def("mark_misused", &dl::MarkMisused, nb::arg("comm"),
        "Refuse every later call on communicator `comm` (two threads used it "
        "at once).");
  m.def("calls_started", &dl::CallsStarted,
        "How many distlinalg MPI calls this process has started.");
  m.def(
      "check_at_exit",
      [](int64_t comm) {
        std::string message;
        {
          nb::gil_scoped_release release;
          message = dl::CheckAtExit(dl::CommFromHandle(comm));
        }
        return message;
      },
      nb::arg("comm"),
      "The end-of-program signature check on `comm`: '' when every rank is "
      "at its end too, else the error message.");
  m.def(
      "start_responder",
      [](int64_t world) {
        int rc;
        {
          nb::gil_scoped_release release;
          rc = dl::StartResponder(dl::CommFromHandle(world));
        }
        if (rc != MPI_SUCCESS) {
          throw std::runtime_error(
              "distlinalg: could not start the responder: " +
              dl::MpiErrorString(rc));
        }
      },
      nb::arg("world"),
      "Start the thread that answers other ranks' queries about this rank's "
      "current call (collective over `world`; needs MPI_THREAD_MULTIPLE).");
  m.def(
      "stop_responder",
      [] {
        nb::gil_scoped_release release;
        dl::StopResponder();
      },
      "Stop the responder thread (before MPI_Finalize).");
  m.def(
      "register_comm",
      [](int64_t key, int64_t handle) { dl::RegisterComm(key, handle); },
      nb::arg("key"), nb::arg("handle"),
      "Map the communicator key that programs carry to this process's "
      "handle.");
  m.def(
      "prepare_checks",
      [](int64_t comm) {
        int rc;
        {
          nb::gil_scoped_release release;
          rc = dl::PrepareChecks(dl::CommFromHandle(comm));
        }
        if (rc != MPI_SUCCESS) {
          throw std::runtime_error(
              "distlinalg: could not create the check "
              "communicator: " +
              dl::MpiErrorString(rc));
        }
      },
      nb::arg("comm"),
      "Create the private check communicator of `comm` (collective).");
}
