// Shared machinery of the distlinalg FFI handlers: communicator handles,
// dtype -> MPI datatype mapping (with user-defined half-precision reductions),
// large-count support, error reporting, debug logging and the optional
// cross-rank signature check.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace distlinalg {

namespace ffi = xla::ffi;

// ---------------------------------------------------------------------------
// Operation codes shared with Python (distlinalg/_mpi.py keeps the same table).
// The bitwise and logical ones take integer and bool buffers only (checked in
// Python).
enum class ReduceOp : int32_t {
  kSum = 0,
  kProd = 1,
  kMin = 2,
  kMax = 3,
  kBand = 4,
  kBor = 5,
  kBxor = 6,
  kLand = 7,
  kLor = 8,
  kLxor = 9,
};

// ---------------------------------------------------------------------------
// Communicator handles travel through XLA as int64 attributes. MPICH's
// MPI_Comm is an int, Open MPI's a pointer: convert either way.
template <typename Comm = MPI_Comm>
inline Comm CommFromHandle(int64_t handle) {
  if constexpr (std::is_integral_v<Comm>) {
    return static_cast<Comm>(handle);
  } else {
    return reinterpret_cast<Comm>(static_cast<intptr_t>(handle));
  }
}

template <typename Comm = MPI_Comm>
inline int64_t HandleFromComm(Comm comm) {
  if constexpr (std::is_integral_v<Comm>) {
    return static_cast<int64_t>(comm);
  } else {
    return static_cast<int64_t>(reinterpret_cast<intptr_t>(comm));
  }
}

// Programs name a communicator by its distlinalg key, not its handle: the
// handle of one communicator differs between ranks (MPICH numbers them in the
// order each process made its communicators, internal ones included), so a
// program holding it would differ on every rank and in every world, and no
// rank could load what another compiled. Keys are given in the order
// communicators are wrapped (distlinalg/_runtime/mpi.py), which is the same
// on every rank of an SPMD program, and each process maps them to its own
// handles here. A key never changes its communicator.
void RegisterComm(int64_t key, int64_t handle);
// The communicator of `key`, or MPI_COMM_NULL if this process has none.
MPI_Comm CommFromKey(int64_t key);
ffi::Error UnknownCommKey(int64_t key);
#define DL_COMM_OF_KEY(var, key)   \
  MPI_Comm var = CommFromKey(key); \
  if (var == MPI_COMM_NULL) return UnknownCommKey(key)

// ---------------------------------------------------------------------------
// Global settings, changed from Python.
struct Settings {
  bool debug_log = false;  // DISTLINALG_DEBUG: log every MPI call
  int check_mode =
      1;  // DISTLINALG_CHECK: 0 off, 1 first run, 2 every call (checks.h)
  bool serialize = false;  // thread level < MULTIPLE: one thread in MPI
  int64_t max_count = std::numeric_limits<int>::max();  // per-call element cap
  // DISTLINALG_CANCELLABLE_WAITS: collectives start nonblocking and are polled,
  // so a poisoned communicator cancels them (checks.h, WaitOrCancel); off, they
  // are MPI's blocking calls (Open MPI's nonblocking collectives
  // cost 1.8-2.6x).
  bool cancellable_collectives = true;
  // DISTLINALG_IDLE_WAIT: a wait that outlasts its spinning and yielding polls
  // sleeps between polls (checks.h, PollPacer): for ranks sharing cores.
  bool idle_sleep = false;
};
Settings& GlobalSettings();
std::mutex& MpiMutex();

// Holds the MPI lock for the duration of a handler when MPI runs below
// THREAD_MULTIPLE (XLA may call handlers from several worker threads).
// Error and diagnostic messages are built with Text, not std::ostringstream.
// iostreams format numbers through the C++ locale's facets, and in a process
// that loads several C++ runtimes' worth of code (JAX's CUDA plugin, PyTorch,
// ...) that machinery is not ours to rely on: on an H100 node with jaxlib
// 0.11's CUDA plugin, `ostringstream << long` in a handler's error path
// segfaulted. Text appends with std::to_string / snprintf alone.
class Text {
 public:
  Text& operator<<(std::string_view s) {
    text_.append(s.data(), s.size());
    return *this;
  }
  Text& operator<<(const char* s) { return *this << std::string_view(s); }
  Text& operator<<(const std::string& s) {
    return *this << std::string_view(s);
  }
  Text& operator<<(char c) {
    text_.push_back(c);
    return *this;
  }
  template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
  Text& operator<<(T value) {
    text_ += std::to_string(value);
    return *this;
  }
  Text& operator<<(double value) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%g", value);
    return *this << static_cast<const char*>(buffer);
  }
  const std::string& str() const { return text_; }

 private:
  std::string text_;
};

class MpiLock {
 public:
  MpiLock() : lock_(MpiMutex(), std::defer_lock) {
    if (GlobalSettings().serialize) lock_.lock();
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

// ---------------------------------------------------------------------------
// Copies and fills of the handlers' own buffers. Plain memcpy/memset on host
// memory; a CUDA handler that hands device pointers to a CUDA-aware MPI
// installs device versions for the duration of its call (cuda_transport.h).
struct BufferOps {
  ffi::Error (*copy)(void* dst, const void* src, size_t bytes);
  ffi::Error (*fill_zero)(void* dst, size_t bytes);
  // Backs a large buffer by transparent huge pages (host: madvise; device:
  // nothing). Advice only: never fails.
  void (*back_by_huge_pages)(const void* data, size_t bytes);
};
const BufferOps& HostBufferOps();
// The ops in force on this thread (HostBufferOps unless a scope replaced them).
const BufferOps*& ThreadBufferOps();

inline ffi::Error CopyBytes(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return ffi::Error::Success();
  return ThreadBufferOps()->copy(dst, src, bytes);
}
inline ffi::Error ZeroBytes(void* dst, size_t bytes) {
  if (bytes == 0) return ffi::Error::Success();
  return ThreadBufferOps()->fill_zero(dst, bytes);
}

// Large messages: MPICH's shared-memory copies run about 2x faster through
// transparent huge pages (2 MiB TLB entries; numpy asks for them on arrays of
// 4 MiB and more, XLA's allocator does not). Every handler passes the buffers
// it gives MPI through here; below kHugePageMinBytes this is a comparison.
inline constexpr size_t kHugePageMinBytes = size_t{4} << 20;
inline void BackByHugePages(const void* data, size_t bytes) {
  if (bytes < kHugePageMinBytes) return;
  ThreadBufferOps()->back_by_huge_pages(data, bytes);
}
inline void BackByHugePages(const ffi::AnyBuffer& b) {
  BackByHugePages(b.untyped_data(), b.size_bytes());
}

#define DL_CHECK(call)                     \
  do {                                     \
    ffi::Error dl_err_ = (call);           \
    if (dl_err_.failure()) return dl_err_; \
  } while (0)

// ---------------------------------------------------------------------------
// Whether the MPI library can take CUDA device pointers, asked at run time
// (Open MPI: MPIX_Query_cuda_support; MPICH >= 4: MPIX_GPU_query_support).
// The symbols are looked up in the libmpi this extension is linked to, so
// the answer does not depend on which mpi.h the build saw.
struct MpiCudaSupport {
  int supported = -1;  // 1 yes, 0 no, -1 the library cannot say
  std::string method;  // how it was determined
};
MpiCudaSupport QueryMpiCudaSupport();

// ---------------------------------------------------------------------------
// Errors: MPI returns codes (communicators carry MPI_ERRORS_RETURN), handlers
// turn them into ffi::Error, which JAX raises as a Python exception.
inline std::string MpiErrorString(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) {
    return "MPI error code " + std::to_string(code);
  }
  return std::string(buf, len);
}

inline ffi::Error MpiError(const char* op, int code) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("distlinalg: MPI error in ") + op + ": " +
                        MpiErrorString(code));
}

#define DL_MPI_CHECK(op, call)                              \
  do {                                                      \
    int dl_rc_ = (call);                                    \
    if (dl_rc_ != MPI_SUCCESS) return MpiError(op, dl_rc_); \
  } while (0)

// ---------------------------------------------------------------------------
// Datatypes.
struct TypeInfo {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  size_t itemsize = 0;
  bool ok = false;
};

// MPI datatype for an XLA element type. float16 and bfloat16 have no MPI
// type: they travel as distinct 2-byte derived types reduced by user ops.
TypeInfo MpiType(ffi::DataType dtype);

// MPI_Op for (op, dtype). bool uses the logical ops for min/max; half
// precision uses user-defined ops. Returns MPI_OP_NULL when unsupported.
MPI_Op MpiOp(ReduceOp op, ffi::DataType dtype);

const char* DtypeName(ffi::DataType dtype);
const char* OpName(ReduceOp op);

// A contiguous datatype of `count` elements of `base`, valid for any count
// (nested when count exceeds the int range). The caller frees it with
// MPI_Type_free. Used for data movement (not reductions) beyond INT_MAX.
int MakeContiguousType(int64_t count, MPI_Datatype base, MPI_Datatype* out);

// RAII for a datatype made by MakeContiguousType.
class BlockType {
 public:
  BlockType() = default;
  ~BlockType() {
    if (owned_) MPI_Type_free(&type_);
  }
  BlockType(const BlockType&) = delete;
  BlockType& operator=(const BlockType&) = delete;
  // Chooses (count, type) so that `count` items of `type` describe `n`
  // elements of `base`: the plain type when n fits the per-call cap,
  // otherwise one item of a contiguous derived type.
  int Init(int64_t n, MPI_Datatype base) {
    if (n <= GlobalSettings().max_count) {
      count_ = static_cast<int>(n);
      type_ = base;
      return MPI_SUCCESS;
    }
    int rc = MakeContiguousType(n, base, &type_);
    if (rc != MPI_SUCCESS) return rc;
    owned_ = true;
    count_ = 1;
    return MPI_SUCCESS;
  }
  int count() const { return count_; }
  MPI_Datatype type() const { return type_; }

 private:
  int count_ = 0;
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
  bool owned_ = false;
};

}  // namespace distlinalg
