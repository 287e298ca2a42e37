// CUDA variants of the FFI handlers (compiled when the build finds cuda.h,
// DL_WITH_CUDA). A CUDA handler runs the CPU handler's implementation, the
// MPI code, either
//   - host-staged (default): operands copied device-to-host on XLA's stream,
//     the stream synchronised, MPI on pinned host buffers, results copied
//     back and the stream synchronised again; or
//   - CUDA-aware: XLA's stream synchronised (the operands' producers are
//     done), then MPI on the device pointers themselves.
// Only the CUDA driver API is used, loaded at run time (dlopen of
// libcuda.so.1, or DISTLINALG_LIBCUDA), so the extension neither links a CUDA
// runtime nor ties itself to the toolkit version it was built with.
#pragma once

#include "mpi_common.h"

#if defined(DL_WITH_CUDA)

#include <cuda.h>

#include <deque>
#include <tuple>
#include <vector>

namespace distlinalg::cuda {

enum class Transport : int { kHostStaged = 0, kCudaAware = 1 };

// Set from Python (distlinalg/_cuda.py) after detection and overrides.
void SetTransport(Transport transport);
Transport CurrentTransport();

// Host staging moves a buffer larger than the staging chunk (default 64 MiB,
// DISTLINALG_CUDA_STAGING_CHUNK) through two pinned blocks of that size, in
// chunks, into pageable host memory released after the call: the pinned
// memory a call holds stays bounded however large its buffers are. Smaller
// buffers are staged whole in pinned blocks recycled between calls.
void SetStagingChunkBytes(size_t bytes);
size_t StagingChunkBytes();

// Loads the driver library if needed; empty string on success, else why not.
std::string DriverStatus();

// Waits for the work queued on `stream`.
ffi::Error Synchronize(CUstream stream);

// Queues zeroing `bytes` of device memory at `dst` on `stream`; does not wait.
ffi::Error ZeroAsync(CUstream stream, void* dst, size_t bytes);

// Host copies of a handler's buffers for one call. Buffers that XLA aliases
// (an operand handed back as the result) share one host copy, so the
// implementation sees the same aliasing as on the CPU.
class Staging {
 public:
  explicit Staging(CUstream stream) : stream_(stream) {}
  ~Staging();
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  // An operand: its host copy, filled by an asynchronous device-to-host copy.
  ffi::AnyBuffer Host(ffi::AnyBuffer device);
  // A result: host space, copied to the device by FinishOutputs.
  ffi::Result<ffi::AnyBuffer> Host(ffi::Result<ffi::AnyBuffer> device);
  // Tokens and attributes pass through.
  template <typename T>
  T Host(T other) {
    return other;
  }

  // Waits for the operand copies (before MPI reads the host buffers).
  ffi::Error FinishInputs();
  // Copies the results to the device and waits, so the host buffers can be
  // reused by the next call.
  ffi::Error FinishOutputs();

 private:
  struct Slot {
    void* device = nullptr;
    void* host = nullptr;
    size_t bytes = 0;
    bool filled = false;   // device-to-host copy issued
    bool result = false;   // copied back after the call
    bool chunked = false;  // pageable host memory, copied through bounce blocks
  };
  Slot& SlotFor(void* device, size_t bytes);
  // The copies of a chunked slot: pipelined through two pinned bounce
  // blocks, a chunk's host-side memcpy overlapping the next chunk's DMA.
  ffi::Error ChunkedToHost(const Slot& slot);
  ffi::Error ChunkedToDevice(const Slot& slot);
  const XLA_FFI_Buffer* HostView(const ffi::AnyBuffer& device, void* host);
  void Fail(ffi::Error error);

  CUstream stream_;
  bool pending_ = false;  // copies issued and not yet waited for
  std::vector<Slot> slots_;
  std::deque<XLA_FFI_Buffer> views_;  // stable addresses for AnyBuffer
  ffi::Error error_ = ffi::Error::Success();
};

// Replaces the handlers' memcpy/memset by stream-ordered device copies for
// the duration of a CUDA-aware call.
class ScopedDeviceBufferOps {
 public:
  explicit ScopedDeviceBufferOps(CUstream stream);
  ~ScopedDeviceBufferOps();

 private:
  const BufferOps* saved_;
};

// Half-precision reductions use user-defined MPI ops, which a CUDA-aware MPI
// would call on device memory: such calls are staged whatever the transport.
inline bool NeedsHost(const ffi::AnyBuffer& b) {
  return b.element_type() == ffi::DataType::F16 ||
         b.element_type() == ffi::DataType::BF16;
}
inline bool NeedsHost(const ffi::Result<ffi::AnyBuffer>&) { return false; }
template <typename T>
bool NeedsHost(const T&) {
  return false;
}

// The CUDA handler of a CPU implementation `Impl(args...)`: takes XLA's
// stream first, then the implementation's arguments. `kAlwaysStaged`: the
// implementation works on host memory of its own (the non-blocking
// operations' request buffers), so its buffers are staged in every transport.
template <typename F, F* Impl, bool kAlwaysStaged = false>
struct OnStream;

template <typename... Args, ffi::Error (*Impl)(Args...), bool kAlwaysStaged>
struct OnStream<ffi::Error(Args...), Impl, kAlwaysStaged> {
  static ffi::Error Call(CUstream stream, Args... args) {
    const bool staged = kAlwaysStaged ||
                        CurrentTransport() == Transport::kHostStaged ||
                        (NeedsHost(args) || ...);
    if (!staged) {
      DL_CHECK(Synchronize(stream));
      ScopedDeviceBufferOps device_ops(stream);
      // MPI's blocking calls return with the device buffers complete.
      return Impl(args...);
    }
    Staging staging(stream);
    // Braced initialisation evaluates left to right: operands are staged in
    // order, and an aliased result finds its operand's host copy.
    std::tuple<Args...> host{staging.Host(args)...};
    DL_CHECK(staging.FinishInputs());
    DL_CHECK(std::apply(Impl, host));
    return staging.FinishOutputs();
  }

  // The same without a stream: a CPU-registered twin used to test the
  // staging logic against a stand-in driver (tests/cuda_driver_stub.c).
  static ffi::Error CallWithoutStream(Args... args) {
    return Call(nullptr, args...);
  }
};

}  // namespace distlinalg::cuda

// Defines `symbol` (the CPU handler), `symbol##Cuda` (XLA's CUDA stream
// first) and `symbol##CudaEmulated` (the CUDA code path registered on the
// CPU, for tests) from one signature macro `SIGNATURE(binding)`.
#define DL_DEFINE_HANDLERS_WITH(symbol, impl, SIGNATURE, staged)            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl, SIGNATURE(ffi::Ffi::Bind())); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                            \
      symbol##Cuda,                                                         \
      (distlinalg::cuda::OnStream<decltype(impl), &impl, staged>::Call),    \
      SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<CUstream>>()));    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                            \
      symbol##CudaEmulated,                                                 \
      (distlinalg::cuda::OnStream<decltype(impl), &impl,                    \
                                  staged>::CallWithoutStream),              \
      SIGNATURE(ffi::Ffi::Bind()))
#define DL_DEFINE_HANDLERS(symbol, impl, SIGNATURE) \
  DL_DEFINE_HANDLERS_WITH(symbol, impl, SIGNATURE, false)
#define DL_DEFINE_STAGED_HANDLERS(symbol, impl, SIGNATURE) \
  DL_DEFINE_HANDLERS_WITH(symbol, impl, SIGNATURE, true)

#else  // no CUDA: the CPU handler only

#define DL_DEFINE_HANDLERS(symbol, impl, SIGNATURE) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl, SIGNATURE(ffi::Ffi::Bind()))
#define DL_DEFINE_STAGED_HANDLERS DL_DEFINE_HANDLERS

#endif
