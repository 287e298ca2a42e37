// Local inner products Σ conj(x)·y of several vector pairs in one pass over
// memory (distlinalg/_kernels/local_dots.py). No MPI: the solvers' dots, each
// rank's share, before their allreduce.
//
// Why a handler: XLA's CPU backend computes vdot(x, y) as a multiply that
// writes the product vector, then a cascade of reduce-windows that reads it
// back (four passes over a vector for two inputs, and its reductions are not
// vectorised): 3.5 ms for 4M float64 against 1.1 ms for a loop that reads x
// and y once. A Krylov iteration has two or three such dots and about ten
// vector passes besides, so the dots were half of CG's time per iteration.
//
// Numerics: every sum accumulates in float64 (float32 and complex64 inputs
// too), blocked and cascaded as csrc/vector_kernels.h describes: as accurate
// as XLA's tree reduction, and the same bits for any thread count.
#include <complex>
#include <vector>

#include "handlers.h"
#include "vector_kernels.h"

namespace distlinalg {
namespace {

using vec::kBlock;
using vec::kChunk;

// One inner product to compute: a pair's vectors (one batch entry of them).
struct Job {
  ffi::DataType dtype;
  const void* x;
  const void* y;
  int64_t n;  // elements (complex ones count once)
  void* out;  // the result's element in the output buffer
};

// The sums of chunk c of every job, block by block, so that vectors shared by
// several pairs (r in ⟨r, u⟩ and ⟨r, r⟩) are read from memory once.
void RunChunk(const std::vector<Job>& jobs, int64_t c,
              std::complex<double>* sums) {
  const int64_t begin = c * kChunk;
  std::vector<vec::ComplexCascade> cascades(jobs.size());
  for (int64_t b = begin; b < begin + kChunk; b += kBlock) {
    bool any = false;
    for (size_t j = 0; j < jobs.size(); ++j) {
      const int64_t count = std::min(kBlock, jobs[j].n - b);
      if (count <= 0) continue;
      any = true;
      cascades[j].Add(
          vec::BlockDot(jobs[j].dtype, jobs[j].x, jobs[j].y, b, count));
    }
    if (!any) break;
  }
  for (size_t j = 0; j < jobs.size(); ++j) sums[j] = cascades[j].Total();
}

}  // namespace

// Operands x₀, y₀, x₁, y₁, …; result i holds Σ conj(x_i)·y_i for each of its
// elements (a pair's batch entries: the operands' leading dimensions).
ffi::Error LocalDotsImpl(ffi::ThreadPool pool, ffi::RemainingArgs args,
                         ffi::RemainingRets rets) {
  if (args.size() != 2 * rets.size()) {
    return ffi::Error(
        ffi::ErrorCode::kInvalidArgument,
        "distlinalg_local_dots: expected two operands per result");
  }
  std::vector<Job> jobs;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto x = args.get<ffi::AnyBuffer>(2 * i);
    auto y = args.get<ffi::AnyBuffer>(2 * i + 1);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (x.has_error()) return x.error();
    if (y.has_error()) return y.error();
    if (out.has_error()) return out.error();
    const ffi::DataType dtype = x->element_type();
    const int64_t batch = static_cast<int64_t>((*out)->element_count());
    if (!vec::IsVectorDtype(dtype) || y->element_type() != dtype ||
        (*out)->element_type() != dtype ||
        x->element_count() != y->element_count() ||
        (batch > 0 && x->element_count() % batch != 0)) {
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "distlinalg_local_dots: operands of one pair must have "
                        "the result's dtype "
                        "(float32, float64, complex64 or complex128) and one "
                        "size, a multiple of the result's");
    }
    const int64_t n =
        batch > 0 ? static_cast<int64_t>(x->element_count()) / batch : 0;
    const int64_t bytes = static_cast<int64_t>(ffi::ByteWidth(dtype));
    for (int64_t e = 0; e < batch; ++e) {
      jobs.push_back(
          {dtype, static_cast<const char*>(x->untyped_data()) + e * n * bytes,
           static_cast<const char*>(y->untyped_data()) + e * n * bytes, n,
           static_cast<char*>((*out)->untyped_data()) + e * bytes});
    }
  }
  int64_t longest = 0;
  for (const Job& job : jobs) longest = std::max(longest, job.n);
  const int64_t chunks = (longest + kChunk - 1) / kChunk;
  std::vector<std::complex<double>> sums(chunks *
                                         jobs.size());  // [chunk * jobs + job]
  vec::ParallelFor(pool, chunks, [&](int64_t c) {
    RunChunk(jobs, c, sums.data() + c * jobs.size());
  });

  for (size_t j = 0; j < jobs.size(); ++j) {
    vec::ComplexCascade total;
    for (int64_t c = 0; c < chunks; ++c) total.Add(sums[c * jobs.size() + j]);
    vec::StoreScalar(jobs[j].dtype, jobs[j].out, total.Total());
  }
  return ffi::Error::Success();
}

}  // namespace distlinalg

XLA_FFI_DEFINE_HANDLER_SYMBOL(DlLocalDots, distlinalg::LocalDotsImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .RemainingRets());
