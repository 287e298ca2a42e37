#include "mpi_common.h"

#include <dlfcn.h>
#include <sys/mman.h>

#include <array>
#include <chrono>

#include <cmath>
#include <unordered_map>

namespace distlinalg {

Settings& GlobalSettings() {
  static Settings settings;
  return settings;
}

std::mutex& MpiMutex() {
  static std::mutex mutex;
  return mutex;
}

// ---------------------------------------------------------------------------
namespace {
ffi::Error HostCopy(void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  return ffi::Error::Success();
}
ffi::Error HostZero(void* dst, size_t bytes) {
  std::memset(dst, 0, bytes);
  return ffi::Error::Success();
}

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux >= 6.1
#endif

// The whole 2 MiB pages inside [data, data + bytes). Pages not yet touched
// (a fresh XLA output) fault in as huge pages after MADV_HUGEPAGE. Pages
// already present as 4 KiB pages (an input XLA wrote, a donated loop carry)
// are merged by MADV_COLLAPSE, which copies them: worth it for a buffer that
// comes back call after call (a loop's carry), a loss for memory the
// allocator maps afresh each time at the same address ("recycled"). A
// collapse of pages that are already huge costs a few µs. So, per range
// (remembered for the last 16 ranges seen):
//   - a collapse that copied counts; one that found huge pages resets the
//     count (the buffer stayed);
//   - two counted collapses in a row mark the range recycled: it is skipped,
//     except every 64th time it is seen, when it is collapsed once more and
//     on its next sighting again: if that second one finds huge pages, a
//     lasting buffer now lives there and the mark is dropped.
// Kernels without THP or MADV_COLLAPSE answer EINVAL: the advice is simply
// not taken.
void HostBackByHugePages(const void* data, size_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  // A collapse that copied pages takes ~150 µs per 2 MiB; one that found
  // them huge, a few µs for the whole range.
  constexpr auto kCollapseDidWork = std::chrono::microseconds(50);
  constexpr int kRecycled = 2;
  constexpr uint32_t kRetryEvery = 64;
  const uintptr_t start =
      (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end =
      (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end <= start) return;
  void* range = reinterpret_cast<void*>(start);
  const size_t length = end - start;
  struct Range {
    uintptr_t start = 0, end = 0;
    int collapses = 0;  // consecutive collapses that copied pages
    uint32_t skipped = 0;
    bool probation = false;  // recycled, collapsed again: is it still?
  };
  // Per thread: handlers run under MpiLock or on one thread per call.
  thread_local std::array<Range, 16> seen{};
  thread_local size_t next = 0;
  madvise(range, length, MADV_HUGEPAGE);
  Range* entry = nullptr;
  for (Range& r : seen) {
    if (r.start == start && r.end == end) entry = &r;
  }
  if (entry != nullptr && entry->collapses >= kRecycled && !entry->probation &&
      ++entry->skipped % kRetryEvery != 0) {
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = madvise(range, length, MADV_COLLAPSE);
  const bool copied =
      rc == 0 && std::chrono::steady_clock::now() - t0 >= kCollapseDidWork;
  if (entry == nullptr) {
    if (!copied) return;
    entry = &seen[next];
    *entry = Range{start, end, 0, 0, false};
    next = (next + 1) % seen.size();
  }
  if (!copied) {
    *entry = Range{start, end, 0, 0, false};  // a buffer that stays: huge now
  } else if (entry->probation) {
    entry->probation = false;  // still recycled
  } else if (entry->collapses >= kRecycled) {
    entry->probation = true;  // the periodic retry copied: look again next time
  } else {
    ++entry->collapses;
  }
}
}  // namespace

const BufferOps& HostBufferOps() {
  static const BufferOps ops{&HostCopy, &HostZero, &HostBackByHugePages};
  return ops;
}

const BufferOps*& ThreadBufferOps() {
  thread_local const BufferOps* ops = &HostBufferOps();
  return ops;
}

// ---------------------------------------------------------------------------
MpiCudaSupport QueryMpiCudaSupport() {
  MpiCudaSupport result;
  // The library that provides MPI_Init to this extension (dladdr), opened
  // again without loading anything, so that dlsym searches exactly it.
  Dl_info info{};
  void* lib = nullptr;
  if (dladdr(reinterpret_cast<void*>(&MPI_Init), &info) != 0 &&
      info.dli_fname != nullptr) {
    lib = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  }
  auto lookup = [&](const char* name) -> void* {
    void* sym = lib != nullptr ? dlsym(lib, name) : nullptr;
    return sym != nullptr ? sym : dlsym(RTLD_DEFAULT, name);
  };
  if (void* sym = lookup("MPIX_Query_cuda_support")) {
    using Query = int (*)();
    result.supported = reinterpret_cast<Query>(sym)() != 0 ? 1 : 0;
    result.method = "MPIX_Query_cuda_support";
  } else if (void* sym = lookup("MPIX_GPU_query_support")) {
    using Query = int (*)(int, int*);
    int supported = 0;
    constexpr int kMpixGpuSupportCuda =
        0;  // MPIX_GPU_SUPPORT_CUDA in MPICH's mpi.h
    if (reinterpret_cast<Query>(sym)(kMpixGpuSupportCuda, &supported) ==
        MPI_SUCCESS) {
      result.supported = supported != 0 ? 1 : 0;
      result.method = "MPIX_GPU_query_support";
    } else {
      result.method = "MPIX_GPU_query_support failed";
    }
  } else {
    result.method = "the MPI library has no CUDA support query";
  }
  if (lib != nullptr) dlclose(lib);
  return result;
}

// ---------------------------------------------------------------------------
// Half-precision arithmetic for the user-defined reductions. Values are
// widened to float, combined, and rounded back once per pairwise step, which
// is what a float16 `a + b` computes on any hardware.
namespace {

float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x0040);
  uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float F16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F;
  uint32_t mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mantissa <<= 1;
      } while ((mantissa & 0x400) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) |
             ((mantissa & 0x3FF) << 13);
    }
  } else if (exponent == 0x1F) {
    bits = sign | 0x7F800000 | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t FloatToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  uint32_t abs = bits & 0x7FFFFFFF;
  if (abs >= 0x7F800000) {  // inf or nan
    return sign | 0x7C00 | (abs > 0x7F800000 ? 0x200 : 0);
  }
  if (abs >= 0x477FF000) return sign | 0x7C00;  // rounds to >= 65520: inf
  if (abs < 0x38800000) {                       // subnormal half or zero
    if (abs < 0x33000000) return sign;          // below half the min subnormal
    uint32_t exponent = abs >> 23;
    uint32_t mantissa = (abs & 0x7FFFFF) | 0x800000;
    // value = mantissa * 2^(exponent - 150); in units of the smallest half
    // subnormal (2^-24) that is mantissa * 2^(exponent - 126).
    uint32_t drop = 126 - exponent;  // 14..24 in this branch
    uint32_t value = mantissa >> drop;
    uint32_t rem = mantissa & ((1u << drop) - 1);
    uint32_t half = 1u << (drop - 1);
    if (rem > half || (rem == half && (value & 1))) ++value;
    return sign | static_cast<uint16_t>(value);
  }
  uint32_t rounded = abs + 0xFFF + ((abs >> 13) & 1);  // nearest even
  return sign | static_cast<uint16_t>(((rounded - 0x38000000) >> 13) & 0x7FFF);
}

MPI_Datatype& F16Type() {
  static MPI_Datatype type = MPI_DATATYPE_NULL;
  return type;
}
MPI_Datatype& Bf16Type() {
  static MPI_Datatype type = MPI_DATATYPE_NULL;
  return type;
}

template <typename Combine>
void HalfReduce(void* in, void* inout, int* len, MPI_Datatype* dtype,
                Combine combine) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  bool bf16 = (*dtype == Bf16Type());
  for (int i = 0; i < *len; ++i) {
    float x = bf16 ? Bf16ToFloat(a[i]) : F16ToFloat(a[i]);
    float y = bf16 ? Bf16ToFloat(b[i]) : F16ToFloat(b[i]);
    float z = combine(x, y);
    b[i] = bf16 ? FloatToBf16(z) : FloatToF16(z);
  }
}

// NaN-propagating min/max, like jnp.minimum / jnp.maximum.
float NanMin(float x, float y) {
  return (std::isnan(x) || std::isnan(y)) ? NAN : (x < y ? x : y);
}
float NanMax(float x, float y) {
  return (std::isnan(x) || std::isnan(y)) ? NAN : (x > y ? x : y);
}

void HalfSum(void* in, void* inout, int* len, MPI_Datatype* dt) {
  HalfReduce(in, inout, len, dt, [](float x, float y) { return x + y; });
}
void HalfProd(void* in, void* inout, int* len, MPI_Datatype* dt) {
  HalfReduce(in, inout, len, dt, [](float x, float y) { return x * y; });
}
void HalfMin(void* in, void* inout, int* len, MPI_Datatype* dt) {
  HalfReduce(in, inout, len, dt, NanMin);
}
void HalfMax(void* in, void* inout, int* len, MPI_Datatype* dt) {
  HalfReduce(in, inout, len, dt, NanMax);
}

MPI_Op half_ops[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};

// Created lazily on first use (after MPI_Init, which mpi4py performs).
std::once_flag half_once;
void InitHalfTypes() {
  std::call_once(half_once, [] {
    MPI_Type_contiguous(2, MPI_BYTE, &F16Type());
    MPI_Type_commit(&F16Type());
    MPI_Type_contiguous(2, MPI_BYTE, &Bf16Type());
    MPI_Type_commit(&Bf16Type());
    MPI_Op_create(&HalfSum, 1, &half_ops[0]);
    MPI_Op_create(&HalfProd, 1, &half_ops[1]);
    MPI_Op_create(&HalfMin, 1, &half_ops[2]);
    MPI_Op_create(&HalfMax, 1, &half_ops[3]);
  });
}

// float32/float64 min and max: MPI's predefined MPI_MIN/MPI_MAX compare with
// < and >, so whether a NaN survives depends on the order in which ranks are
// combined (it differs between ranks and algorithms). These propagate NaN,
// like jnp.minimum/jnp.maximum and the half-precision ops above.
template <typename T, bool kMax>
void NanExtremum(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const T x = a[i], y = b[i];
    b[i] = (x != x)   ? x
           : (y != y) ? y
                      : (kMax ? (x > y ? x : y) : (x < y ? x : y));
  }
}

// [min f32, max f32, min f64, max f64]
MPI_Op float_ops[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
std::once_flag float_once;
void InitFloatOps() {
  std::call_once(float_once, [] {
    MPI_Op_create(&NanExtremum<float, false>, 1, &float_ops[0]);
    MPI_Op_create(&NanExtremum<float, true>, 1, &float_ops[1]);
    MPI_Op_create(&NanExtremum<double, false>, 1, &float_ops[2]);
    MPI_Op_create(&NanExtremum<double, true>, 1, &float_ops[3]);
  });
}

}  // namespace

TypeInfo MpiType(ffi::DataType dtype) {
  using DT = ffi::DataType;
  switch (dtype) {
    case DT::PRED:
      return {MPI_C_BOOL, 1, true};
    case DT::S8:
      return {MPI_INT8_T, 1, true};
    case DT::S16:
      return {MPI_INT16_T, 2, true};
    case DT::S32:
      return {MPI_INT32_T, 4, true};
    case DT::S64:
      return {MPI_INT64_T, 8, true};
    case DT::U8:
      return {MPI_UINT8_T, 1, true};
    case DT::U16:
      return {MPI_UINT16_T, 2, true};
    case DT::U32:
      return {MPI_UINT32_T, 4, true};
    case DT::U64:
      return {MPI_UINT64_T, 8, true};
    case DT::F32:
      return {MPI_FLOAT, 4, true};
    case DT::F64:
      return {MPI_DOUBLE, 8, true};
    case DT::C64:
      return {MPI_C_FLOAT_COMPLEX, 8, true};
    case DT::C128:
      return {MPI_C_DOUBLE_COMPLEX, 16, true};
    case DT::F16:
      InitHalfTypes();
      return {F16Type(), 2, true};
    case DT::BF16:
      InitHalfTypes();
      return {Bf16Type(), 2, true};
    default:
      return {};
  }
}

MPI_Op MpiOp(ReduceOp op, ffi::DataType dtype) {
  using DT = ffi::DataType;
  bool complex = dtype == DT::C64 || dtype == DT::C128;
  bool floating = complex || dtype == DT::F16 || dtype == DT::BF16 ||
                  dtype == DT::F32 || dtype == DT::F64;
  if (op >= ReduceOp::kBand && op <= ReduceOp::kLxor) {
    if (floating) return MPI_OP_NULL;
    if (dtype == DT::PRED) {  // MPI's bitwise ops do not take MPI_C_BOOL; on
                              // bools they are the logical ones
      if (op == ReduceOp::kBand || op == ReduceOp::kLand) return MPI_LAND;
      if (op == ReduceOp::kBor || op == ReduceOp::kLor) return MPI_LOR;
      return MPI_LXOR;
    }
    switch (op) {
      case ReduceOp::kBand:
        return MPI_BAND;
      case ReduceOp::kBor:
        return MPI_BOR;
      case ReduceOp::kBxor:
        return MPI_BXOR;
      case ReduceOp::kLand:
        return MPI_LAND;
      case ReduceOp::kLor:
        return MPI_LOR;
      default:
        return MPI_LXOR;
    }
  }
  if (op < ReduceOp::kSum || op > ReduceOp::kMax) return MPI_OP_NULL;
  if (dtype == DT::F16 || dtype == DT::BF16) {
    InitHalfTypes();
    return half_ops[static_cast<int>(op)];
  }
  if ((dtype == DT::F32 || dtype == DT::F64) &&
      (op == ReduceOp::kMin || op == ReduceOp::kMax)) {
    InitFloatOps();
    return float_ops[(dtype == DT::F64 ? 2 : 0) +
                     (op == ReduceOp::kMax ? 1 : 0)];
  }
  if (dtype == DT::PRED) {
    switch (op) {
      case ReduceOp::kMin:
        return MPI_LAND;
      case ReduceOp::kMax:
        return MPI_LOR;
      default:
        return MPI_OP_NULL;
    }
  }
  switch (op) {
    case ReduceOp::kSum:
      return MPI_SUM;
    case ReduceOp::kProd:
      return MPI_PROD;
    case ReduceOp::kMin:
      return complex ? MPI_OP_NULL : MPI_MIN;
    case ReduceOp::kMax:
      return complex ? MPI_OP_NULL : MPI_MAX;
    default:
      return MPI_OP_NULL;
  }
}

const char* DtypeName(ffi::DataType dtype) {
  using DT = ffi::DataType;
  switch (dtype) {
    case DT::PRED:
      return "bool";
    case DT::S8:
      return "int8";
    case DT::S16:
      return "int16";
    case DT::S32:
      return "int32";
    case DT::S64:
      return "int64";
    case DT::U8:
      return "uint8";
    case DT::U16:
      return "uint16";
    case DT::U32:
      return "uint32";
    case DT::U64:
      return "uint64";
    case DT::F16:
      return "float16";
    case DT::BF16:
      return "bfloat16";
    case DT::F32:
      return "float32";
    case DT::F64:
      return "float64";
    case DT::C64:
      return "complex64";
    case DT::C128:
      return "complex128";
    default:
      return "unsupported";
  }
}

const char* OpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kProd:
      return "prod";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kBand:
      return "band";
    case ReduceOp::kBor:
      return "bor";
    case ReduceOp::kBxor:
      return "bxor";
    case ReduceOp::kLand:
      return "land";
    case ReduceOp::kLor:
      return "lor";
    case ReduceOp::kLxor:
      return "lxor";
  }
  return "?";
}

int MakeContiguousType(int64_t count, MPI_Datatype base, MPI_Datatype* out) {
  // count = q * chunk + r with chunk <= cap: a contiguous type of q chunks,
  // followed (through a struct) by the r remaining elements.
  const int64_t chunk = GlobalSettings().max_count;
  const int64_t q = count / chunk;
  const int64_t r = count % chunk;
  MPI_Datatype chunk_type, body;
  int rc = MPI_Type_contiguous(static_cast<int>(chunk), base, &chunk_type);
  if (rc != MPI_SUCCESS) return rc;
  rc = MPI_Type_contiguous(static_cast<int>(q), chunk_type, &body);
  MPI_Type_free(&chunk_type);
  if (rc != MPI_SUCCESS) return rc;
  if (r == 0) {
    *out = body;
  } else {
    MPI_Datatype tail;
    rc = MPI_Type_contiguous(static_cast<int>(r), base, &tail);
    if (rc != MPI_SUCCESS) return rc;
    MPI_Aint lb, extent;
    MPI_Type_get_extent(base, &lb, &extent);
    int lengths[2] = {1, 1};
    MPI_Aint displs[2] = {0, static_cast<MPI_Aint>(q * chunk) * extent};
    MPI_Datatype types[2] = {body, tail};
    rc = MPI_Type_create_struct(2, lengths, displs, types, out);
    MPI_Type_free(&body);
    MPI_Type_free(&tail);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_Type_commit(out);
}

// ---------------------------------------------------------------------------
// Communicator keys (mpi_common.h).
namespace {
std::mutex& KeyMutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<int64_t, int64_t>& Keys() {
  static std::unordered_map<int64_t, int64_t> keys;
  return keys;
}
}  // namespace

void RegisterComm(int64_t key, int64_t handle) {
  std::lock_guard<std::mutex> lock(KeyMutex());
  Keys()[key] = handle;
}

MPI_Comm CommFromKey(int64_t key) {
  std::lock_guard<std::mutex> lock(KeyMutex());
  auto it = Keys().find(key);
  return it == Keys().end() ? MPI_COMM_NULL : CommFromHandle(it->second);
}

ffi::Error UnknownCommKey(int64_t key) {
  return ffi::Error(
      ffi::ErrorCode::kInternal,
      "distlinalg: the program names communicator key " + std::to_string(key) +
          ", which this process never registered (a program lowered in "
          "another process?)");
}

}  // namespace distlinalg
