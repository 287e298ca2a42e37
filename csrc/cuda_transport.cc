// The CUDA driver calls behind the CUDA handlers: loading the driver, pinned
// host buffers, staging copies on XLA's stream, device-side buffer ops.
#include "cuda_transport.h"

#if defined(DL_WITH_CUDA)

#include <dlfcn.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace distlinalg::cuda {
namespace {

// ---------------------------------------------------------------------------
// The driver API, resolved by name from libcuda. The versioned names are the
// ABI symbols cuda.h maps the plain names to.
struct Driver {
  decltype(&::cuInit) init = nullptr;
  decltype(&::cuGetErrorString) error_string = nullptr;
  decltype(&::cuMemcpyDtoHAsync_v2) copy_to_host = nullptr;
  decltype(&::cuMemcpyHtoDAsync_v2) copy_to_device = nullptr;
  decltype(&::cuMemcpyDtoDAsync_v2) copy_on_device = nullptr;
  decltype(&::cuMemsetD8Async) fill_bytes = nullptr;
  decltype(&::cuStreamSynchronize) synchronize = nullptr;
  decltype(&::cuMemHostAlloc) host_alloc = nullptr;
  decltype(&::cuEventCreate) event_create = nullptr;
  decltype(&::cuEventRecord) event_record = nullptr;
  decltype(&::cuEventSynchronize) event_synchronize = nullptr;
  decltype(&::cuEventDestroy_v2) event_destroy = nullptr;
  std::string error;  // empty once loaded
};

template <typename Fn>
bool Resolve(void* lib, const char* name, Fn* fn, std::string* error) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*fn == nullptr && error->empty()) {
    *error = std::string("symbol ") + name + " missing from the CUDA driver";
  }
  return *fn != nullptr;
}

const Driver& LoadDriver() {
  static Driver driver;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* path = std::getenv("DISTLINALG_LIBCUDA");
    if (path == nullptr || *path == '\0') path = "libcuda.so.1";
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      driver.error = std::string("cannot load the CUDA driver ") + path + ": " +
                     (why != nullptr ? why : "unknown error");
      return;
    }
    std::string& e = driver.error;
    Resolve(lib, "cuInit", &driver.init, &e);
    Resolve(lib, "cuGetErrorString", &driver.error_string, &e);
    Resolve(lib, "cuMemcpyDtoHAsync_v2", &driver.copy_to_host, &e);
    Resolve(lib, "cuMemcpyHtoDAsync_v2", &driver.copy_to_device, &e);
    Resolve(lib, "cuMemcpyDtoDAsync_v2", &driver.copy_on_device, &e);
    Resolve(lib, "cuMemsetD8Async", &driver.fill_bytes, &e);
    Resolve(lib, "cuStreamSynchronize", &driver.synchronize, &e);
    Resolve(lib, "cuMemHostAlloc", &driver.host_alloc, &e);
    Resolve(lib, "cuEventCreate", &driver.event_create, &e);
    Resolve(lib, "cuEventRecord", &driver.event_record, &e);
    Resolve(lib, "cuEventSynchronize", &driver.event_synchronize, &e);
    Resolve(lib, "cuEventDestroy_v2", &driver.event_destroy, &e);
    if (e.empty()) {
      CUresult rc = driver.init(0);
      if (rc != CUDA_SUCCESS)
        e = "cuInit failed with code " + std::to_string(rc);
    }
  });
  return driver;
}

ffi::Error CudaError(const char* what, CUresult rc) {
  const char* text = nullptr;
  const Driver& d = LoadDriver();
  if (d.error_string != nullptr) d.error_string(rc, &text);
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("distlinalg: CUDA ") + what + " failed: " +
                        (text != nullptr ? text : std::to_string(rc)));
}

// The driver or an error explaining why it is unusable.
const Driver* DriverOrNull(ffi::Error* error) {
  const Driver& d = LoadDriver();
  if (!d.error.empty()) {
    *error = ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "distlinalg: " + d.error);
    return nullptr;
  }
  return &d;
}

CUdeviceptr DevicePtr(const void* p) {
  return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p));
}

// ---------------------------------------------------------------------------
// Pinned host blocks, recycled by power-of-two size class. Pinned memory makes
// the staging copies true DMA transfers; allocating it costs milliseconds, so
// blocks are kept for the life of the process (never freed: at exit the
// driver may already be gone).
class PinnedPool {
 public:
  static PinnedPool& Get() {
    static PinnedPool pool;
    return pool;
  }
  void* Take(size_t bytes, ffi::Error* error) {
    size_t size = 64;
    while (size < bytes) size <<= 1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        return p;
      }
    }
    const Driver* d = DriverOrNull(error);
    if (d == nullptr) return nullptr;
    void* p = nullptr;
    CUresult rc = d->host_alloc(&p, size, 0);
    if (rc != CUDA_SUCCESS) {
      *error = CudaError("cuMemHostAlloc", rc);
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    sizes_[p] = size;
    return p;
  }
  void Give(void* p) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_[sizes_.at(p)].push_back(p);
  }

 private:
  std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_;
  std::map<void*, size_t> sizes_;
};

std::atomic<int> g_transport{static_cast<int>(Transport::kHostStaged)};
std::atomic<size_t> g_staging_chunk{size_t{64} << 20};

// Two pinned blocks of one staging chunk, each with an event marking when
// the copy last queued on it is done: the bounce buffers of one chunked copy.
// Destroyed only after the stream is idle, so no copy is still in flight
// into a block handed back to the pool.
class BouncePair {
 public:
  BouncePair(const Driver& d, CUstream stream, size_t chunk, ffi::Error* error)
      : d_(d), stream_(stream) {
    for (int i = 0; i < 2; ++i) {
      block[i] = PinnedPool::Get().Take(chunk, error);
      if (block[i] == nullptr) return;
      CUresult rc = d_.event_create(&done[i], CU_EVENT_DISABLE_TIMING);
      if (rc != CUDA_SUCCESS) {
        *error = CudaError("cuEventCreate", rc);
        return;
      }
    }
  }
  ~BouncePair() {
    (void)d_.synchronize(stream_);
    for (int i = 0; i < 2; ++i) {
      if (block[i] != nullptr) PinnedPool::Get().Give(block[i]);
      if (done[i] != nullptr) (void)d_.event_destroy(done[i]);
    }
  }
  BouncePair(const BouncePair&) = delete;
  BouncePair& operator=(const BouncePair&) = delete;

  void* block[2] = {nullptr, nullptr};
  CUevent done[2] = {nullptr, nullptr};

 private:
  const Driver& d_;
  CUstream stream_;
};

// Pageable host memory for a chunked slot: its own mapping, returned to the
// system when the call ends, and advised for huge pages (MPI's shared-memory
// copies run faster through them; mpi_common.cc).
void* MapPageable(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
#if defined(MADV_HUGEPAGE)
  (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return p;
}

// Device versions of the handlers' buffer ops: queued on the call's stream
// and waited for, because MPI reads the buffers right after.
thread_local CUstream t_stream = nullptr;

ffi::Error DeviceCopy(void* dst, const void* src, size_t bytes) {
  ffi::Error error = ffi::Error::Success();
  const Driver* d = DriverOrNull(&error);
  if (d == nullptr) return error;
  CUresult rc =
      d->copy_on_device(DevicePtr(dst), DevicePtr(src), bytes, t_stream);
  if (rc != CUDA_SUCCESS) return CudaError("cuMemcpyDtoDAsync", rc);
  return Synchronize(t_stream);
}

ffi::Error DeviceZero(void* dst, size_t bytes) {
  ffi::Error error = ffi::Error::Success();
  const Driver* d = DriverOrNull(&error);
  if (d == nullptr) return error;
  CUresult rc = d->fill_bytes(DevicePtr(dst), 0, bytes, t_stream);
  if (rc != CUDA_SUCCESS) return CudaError("cuMemsetD8Async", rc);
  return Synchronize(t_stream);
}

// Device memory has no host page tables to advise.
void DeviceBackByHugePages(const void*, size_t) {}

const BufferOps kDeviceBufferOps{&DeviceCopy, &DeviceZero,
                                 &DeviceBackByHugePages};

}  // namespace

// ---------------------------------------------------------------------------
void SetTransport(Transport transport) {
  g_transport.store(static_cast<int>(transport));
}

Transport CurrentTransport() {
  return static_cast<Transport>(g_transport.load());
}

void SetStagingChunkBytes(size_t bytes) {
  g_staging_chunk.store(std::max<size_t>(bytes, 64));
}

size_t StagingChunkBytes() { return g_staging_chunk.load(); }

std::string DriverStatus() { return LoadDriver().error; }

ffi::Error Synchronize(CUstream stream) {
  ffi::Error error = ffi::Error::Success();
  const Driver* d = DriverOrNull(&error);
  if (d == nullptr) return error;
  CUresult rc = d->synchronize(stream);
  if (rc != CUDA_SUCCESS) return CudaError("cuStreamSynchronize", rc);
  return ffi::Error::Success();
}

ffi::Error ZeroAsync(CUstream stream, void* dst, size_t bytes) {
  ffi::Error error = ffi::Error::Success();
  const Driver* d = DriverOrNull(&error);
  if (d == nullptr) return error;
  CUresult rc = d->fill_bytes(DevicePtr(dst), 0, bytes, stream);
  if (rc != CUDA_SUCCESS) return CudaError("cuMemsetD8Async", rc);
  return ffi::Error::Success();
}

ScopedDeviceBufferOps::ScopedDeviceBufferOps(CUstream stream)
    : saved_(ThreadBufferOps()) {
  t_stream = stream;
  ThreadBufferOps() = &kDeviceBufferOps;
}

ScopedDeviceBufferOps::~ScopedDeviceBufferOps() {
  ThreadBufferOps() = saved_;
  t_stream = nullptr;
}

// ---------------------------------------------------------------------------
Staging::~Staging() {
  // After a failure, copies may still be in flight into the blocks about to
  // be recycled.
  if (pending_) (void)Synchronize(stream_);
  for (Slot& slot : slots_) {
    if (slot.host == nullptr) continue;
    if (slot.chunked) {
      munmap(slot.host, slot.bytes);
    } else {
      PinnedPool::Get().Give(slot.host);
    }
  }
}

void Staging::Fail(ffi::Error error) {
  if (!error_.failure()) error_ = std::move(error);
}

Staging::Slot& Staging::SlotFor(void* device, size_t bytes) {
  for (Slot& slot : slots_) {
    if (bytes > 0 && slot.device == device && slot.bytes == bytes) return slot;
  }
  Slot slot;
  slot.device = device;
  slot.bytes = bytes;
  if (bytes > StagingChunkBytes()) {
    slot.chunked = true;
    slot.host = MapPageable(bytes);
    if (slot.host == nullptr) {
      Fail(ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "distlinalg: cannot map " + std::to_string(bytes) +
                          " bytes of host memory to stage a CUDA buffer"));
    }
  } else if (bytes > 0) {
    ffi::Error error = ffi::Error::Success();
    slot.host = PinnedPool::Get().Take(bytes, &error);
    if (slot.host == nullptr) Fail(std::move(error));
  }
  slots_.push_back(slot);
  return slots_.back();
}

const XLA_FFI_Buffer* Staging::HostView(const ffi::AnyBuffer& device,
                                        void* host) {
  auto dims = device.dimensions();
  XLA_FFI_Buffer view{};
  view.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
  view.extension_start = nullptr;
  view.dtype = static_cast<XLA_FFI_DataType>(device.element_type());
  view.data = host;
  view.rank = static_cast<int64_t>(dims.size());
  view.dims = const_cast<int64_t*>(dims.begin());
  views_.push_back(view);
  return &views_.back();
}

ffi::AnyBuffer Staging::Host(ffi::AnyBuffer device) {
  Slot& slot = SlotFor(device.untyped_data(), device.size_bytes());
  if (!slot.filled && slot.host != nullptr) {
    slot.filled = true;
    ffi::Error error = ffi::Error::Success();
    if (slot.chunked) {
      ffi::Error copied = ChunkedToHost(slot);
      if (copied.failure()) Fail(std::move(copied));
    } else if (const Driver* d = DriverOrNull(&error)) {
      CUresult rc = d->copy_to_host(slot.host, DevicePtr(slot.device),
                                    slot.bytes, stream_);
      pending_ = true;
      if (rc != CUDA_SUCCESS) Fail(CudaError("cuMemcpyDtoHAsync", rc));
    } else {
      Fail(std::move(error));
    }
  }
  return ffi::AnyBuffer(HostView(device, slot.host));
}

ffi::Result<ffi::AnyBuffer> Staging::Host(ffi::Result<ffi::AnyBuffer> device) {
  Slot& slot = SlotFor(device->untyped_data(), device->size_bytes());
  slot.result = true;
  return ffi::Result<ffi::AnyBuffer>(
      ffi::AnyBuffer(HostView(*device, slot.host)));
}

ffi::Error Staging::FinishInputs() {
  if (error_.failure()) return error_;
  DL_CHECK(Synchronize(stream_));
  pending_ = false;
  return ffi::Error::Success();
}

ffi::Error Staging::FinishOutputs() {
  ffi::Error error = ffi::Error::Success();
  const Driver* d = DriverOrNull(&error);
  if (d == nullptr) return error;
  for (const Slot& slot : slots_) {
    if (!slot.result || slot.host == nullptr) continue;
    if (slot.chunked) {
      DL_CHECK(ChunkedToDevice(slot));
      continue;
    }
    CUresult rc = d->copy_to_device(DevicePtr(slot.device), slot.host,
                                    slot.bytes, stream_);
    pending_ = true;
    if (rc != CUDA_SUCCESS) return CudaError("cuMemcpyHtoDAsync", rc);
  }
  DL_CHECK(Synchronize(stream_));
  pending_ = false;
  return ffi::Error::Success();
}

// Chunk k of a slot goes through bounce block k % 2. Before a block takes
// chunk k, its event says chunk k - 2 is through the DMA engine.
ffi::Error Staging::ChunkedToHost(const Slot& slot) {
  ffi::Error error = ffi::Error::Success();
  const Driver* d = DriverOrNull(&error);
  if (d == nullptr) return error;
  const size_t chunk = StagingChunkBytes();
  BouncePair bounce(*d, stream_, chunk, &error);
  if (error.failure()) return error;
  pending_ = true;
  const size_t chunks = (slot.bytes + chunk - 1) / chunk;
  const auto length = [&](size_t k) {
    return std::min(chunk, slot.bytes - k * chunk);
  };
  auto* host = static_cast<char*>(slot.host);
  // Waits for chunk k's copy into its block, then moves it to the host buffer.
  const auto land = [&](size_t k) -> ffi::Error {
    CUresult rc = d->event_synchronize(bounce.done[k % 2]);
    if (rc != CUDA_SUCCESS) return CudaError("cuEventSynchronize", rc);
    std::memcpy(host + k * chunk, bounce.block[k % 2], length(k));
    return ffi::Error::Success();
  };
  for (size_t k = 0; k < chunks; ++k) {
    if (k >= 2) DL_CHECK(land(k - 2));
    CUresult rc =
        d->copy_to_host(bounce.block[k % 2], DevicePtr(slot.device) + k * chunk,
                        length(k), stream_);
    if (rc != CUDA_SUCCESS) return CudaError("cuMemcpyDtoHAsync", rc);
    rc = d->event_record(bounce.done[k % 2], stream_);
    if (rc != CUDA_SUCCESS) return CudaError("cuEventRecord", rc);
  }
  for (size_t k = chunks >= 2 ? chunks - 2 : 0; k < chunks; ++k)
    DL_CHECK(land(k));
  return ffi::Error::Success();
}

ffi::Error Staging::ChunkedToDevice(const Slot& slot) {
  ffi::Error error = ffi::Error::Success();
  const Driver* d = DriverOrNull(&error);
  if (d == nullptr) return error;
  const size_t chunk = StagingChunkBytes();
  BouncePair bounce(*d, stream_, chunk, &error);
  if (error.failure()) return error;
  pending_ = true;
  const size_t chunks = (slot.bytes + chunk - 1) / chunk;
  const auto* host = static_cast<const char*>(slot.host);
  for (size_t k = 0; k < chunks; ++k) {
    const size_t bytes = std::min(chunk, slot.bytes - k * chunk);
    if (k >= 2) {  // chunk k - 2 has left this block
      CUresult rc = d->event_synchronize(bounce.done[k % 2]);
      if (rc != CUDA_SUCCESS) return CudaError("cuEventSynchronize", rc);
    }
    std::memcpy(bounce.block[k % 2], host + k * chunk, bytes);
    CUresult rc = d->copy_to_device(DevicePtr(slot.device) + k * chunk,
                                    bounce.block[k % 2], bytes, stream_);
    if (rc != CUDA_SUCCESS) return CudaError("cuMemcpyHtoDAsync", rc);
    rc = d->event_record(bounce.done[k % 2], stream_);
    if (rc != CUDA_SUCCESS) return CudaError("cuEventRecord", rc);
  }
  return ffi::Error::Success();  // (the bounce blocks wait for the stream)
}

}  // namespace distlinalg::cuda

#endif  // DL_WITH_CUDA
