// Building blocks of the host vector handlers (csrc/local_dots.cc,
// csrc/fused_update.cc): blocked inner products accumulated in float64 with a
// pairwise cascade, and the split of a call's work into fixed chunks that
// XLA's intra-op threads share with the calling thread.
//
// Numerics: eight independent accumulators over blocks of kBlock elements,
// the block sums combined pairwise (a binary cascade), as are the sums of the
// kChunk-element chunks: error O((64 + log2 n)·ε), as good as XLA's tree
// reduction, and the result does not depend on the thread count (the chunks
// and the order of their combination are fixed).
#pragma once

#include <algorithm>
#include <atomic>
#include <complex>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace distlinalg {
namespace vec {

namespace ffi = xla::ffi;

constexpr int64_t kBlock =
    512;  // elements per block (8 accumulators of 64 terms)
constexpr int64_t kChunk = 32768;  // elements per unit of work of one thread

// A pairwise sum of a stream of values: a binary counter of partial sums, the
// partial sum at level i covering 2^i values.
class Cascade {
 public:
  void Add(double v) {
    int level = 0;
    for (uint64_t c = count_; c & 1; c >>= 1, ++level) v += partial_[level];
    partial_[level] = v;
    ++count_;
  }
  double Total() const {
    double total = 0.0;
    int level = 0;
    for (uint64_t c = count_; c; c >>= 1, ++level) {
      if (c & 1) total += partial_[level];
    }
    return total;
  }

 private:
  double partial_[64] = {};
  uint64_t count_ = 0;
};

// The same for complex values.
class ComplexCascade {
 public:
  void Add(std::complex<double> v) {
    re_.Add(v.real());
    im_.Add(v.imag());
  }
  std::complex<double> Total() const { return {re_.Total(), im_.Total()}; }

 private:
  Cascade re_, im_;
};

// Σ x_i y_i over n real elements (float or double), in float64.
template <typename T>
inline double RealBlockDot(const T* x, const T* y, int64_t n) {
  double s[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j)
      s[j] += static_cast<double>(x[i + j]) * static_cast<double>(y[i + j]);
  }
  double tail = 0.0;
  for (; i < n; ++i)
    tail += static_cast<double>(x[i]) * static_cast<double>(y[i]);
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7])) +
         tail;
}

// Σ conj(x_k) y_k over n complex elements stored as (re, im) pairs:
// re = Σ xr yr + xi yi (the real dot of the 2n components), im = Σ xr yi − xi
// yr.
template <typename T>
inline std::complex<double> ComplexBlockDot(const T* x, const T* y, int64_t n) {
  double re[8] = {}, im[8] = {};
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    const T* a = x + 2 * k;
    const T* b = y + 2 * k;
    for (int j = 0; j < 8; ++j)
      re[j] += static_cast<double>(a[j]) * static_cast<double>(b[j]);
    for (int j = 0; j < 8; j += 2) {
      im[j] += static_cast<double>(a[j]) * static_cast<double>(b[j + 1]);
      im[j + 1] -= static_cast<double>(a[j + 1]) * static_cast<double>(b[j]);
    }
  }
  double tail_re = 0.0, tail_im = 0.0;
  for (; k < n; ++k) {
    const double xr = x[2 * k], xi = x[2 * k + 1], yr = y[2 * k],
                 yi = y[2 * k + 1];
    tail_re += xr * yr + xi * yi;
    tail_im += xr * yi - xi * yr;
  }
  auto pairwise = [](const double* s) {
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
  };
  return {pairwise(re) + tail_re, pairwise(im) + tail_im};
}

// Σ conj(x)·y over a block of `count` elements of `dtype` at element `begin`.
inline std::complex<double> BlockDot(ffi::DataType dtype, const void* x,
                                     const void* y, int64_t begin,
                                     int64_t count) {
  switch (dtype) {
    case ffi::DataType::F32:
      return RealBlockDot(static_cast<const float*>(x) + begin,
                          static_cast<const float*>(y) + begin, count);
    case ffi::DataType::F64:
      return RealBlockDot(static_cast<const double*>(x) + begin,
                          static_cast<const double*>(y) + begin, count);
    case ffi::DataType::C64:
      return ComplexBlockDot(static_cast<const float*>(x) + 2 * begin,
                             static_cast<const float*>(y) + 2 * begin, count);
    default:  // C128 (callers send no other dtype)
      return ComplexBlockDot(static_cast<const double*>(x) + 2 * begin,
                             static_cast<const double*>(y) + 2 * begin, count);
  }
}

inline bool IsVectorDtype(ffi::DataType dtype) {
  return dtype == ffi::DataType::F32 || dtype == ffi::DataType::F64 ||
         dtype == ffi::DataType::C64 || dtype == ffi::DataType::C128;
}

// Writes `value` as an element of `dtype` (the real part for real dtypes).
inline void StoreScalar(ffi::DataType dtype, void* out,
                        std::complex<double> value) {
  switch (dtype) {
    case ffi::DataType::F32:
      *static_cast<float*>(out) = static_cast<float>(value.real());
      break;
    case ffi::DataType::F64:
      *static_cast<double*>(out) = value.real();
      break;
    case ffi::DataType::C64:
      *static_cast<std::complex<float>*>(out) = std::complex<float>(value);
      break;
    default:
      *static_cast<std::complex<double>*>(out) = value;
      break;
  }
}

// Runs run(u) for u = 0 … units − 1 on the calling thread and up to
// pool.num_threads() − 1 helpers from XLA's intra-op pool. The calling thread
// takes units too and waits only for units already taken, so a pool with no
// free thread cannot stall the call; late helpers find none left (they hold
// the shared state alive through their copy of the pointer).
inline void ParallelFor(ffi::ThreadPool& pool, int64_t units,
                        std::function<void(int64_t)> run) {
  struct Shared {
    std::function<void(int64_t)> run;
    int64_t units;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};
    void Drain() {
      for (int64_t u; (u = next.fetch_add(1)) < units;) {
        run(u);
        finished.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>();
  shared->run = std::move(run);
  shared->units = units;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), units) - 1;
  for (int64_t h = 0; h < helpers; ++h)
    pool.Schedule([shared] { shared->Drain(); });
  shared->Drain();
  while (shared->finished.load(std::memory_order_acquire) < units)
    std::this_thread::yield();
}

}  // namespace vec
}  // namespace distlinalg
