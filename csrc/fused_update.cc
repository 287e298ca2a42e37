// Linear combinations of vectors and inner products of the results, in one
// pass over memory (distlinalg/_kernels/fused_update.py). No MPI: a Krylov
// step's vector updates and its local dots, before their allreduce.
//
// Why a handler: XLA's CPU backend has no multi-output fusion, so a step such
// as x ← x + α p, r ← r − α q, ρ = ⟨r, r⟩ is two update passes and a dot that
// reads r again; and an update whose result also feeds a dot is written to
// memory before the dot reads it back. Here the vectors go block by block
// (512 elements): the new values computed into a scratch block (each with
// all its terms' sources streamed at once), the dots taken on it, and the
// block stored (over an operand, when the lowering aliases the result to
// it: XLA then updates a loop-carried vector in place).
//
// Operands: the coefficients (batch × T), then the vectors v₀ … v_{n−1}
// (batch × N each, one dtype). Results: m vectors, then the dots (batch × D).
// Attributes:
//   counts  m entries: output j has counts[j] terms;
//   terms   T entries: each term's vector, an index into L = (v₀ … v_{n−1},
//           out₀ … out_{m−1}); output j may use outputs before it only;
//   dots    2D entries: pairs (a, b) of indices into L, Σ conj(L[a])·L[b].
// out_j = Σ_t c_t · L[terms_t] over its terms, in the vectors' dtype; the dots
// accumulate in float64 and cascade as csrc/vector_kernels.h describes, so
// the result has the same bits for any thread count.
#include <complex>
#include <cstring>
#include <vector>

#include "handlers.h"
#include "vector_kernels.h"

namespace distlinalg {
namespace {

using vec::kBlock;
using vec::kChunk;

constexpr int64_t kMaxOutputs = 8;

// out[0, n) = Σ_t c_t · s_t[0, n) for K terms, every source streamed at once.
// n counts scalars of R: elements, or (re, im) pairs of complex ones (then
// the coefficients are pairs too).
template <typename R, bool kComplex, int K>
void CombineFixed(R* out, const R* const* srcs, const R* coefs, int64_t n) {
  const R* __restrict s[K];
  R cr[K], ci[K];
  for (int t = 0; t < K; ++t) {
    s[t] = srcs[t];
    cr[t] = coefs[kComplex ? 2 * t : t];
    ci[t] = kComplex ? coefs[2 * t + 1] : R(0);
  }
  if constexpr (kComplex) {
    for (int64_t i = 0; i < n; i += 2) {
      R re = 0, im = 0;
      for (int t = 0; t < K; ++t) {
        re += cr[t] * s[t][i] - ci[t] * s[t][i + 1];
        im += cr[t] * s[t][i + 1] + ci[t] * s[t][i];
      }
      out[i] = re;
      out[i + 1] = im;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      R v = 0;
      for (int t = 0; t < K; ++t) v += cr[t] * s[t][i];
      out[i] = v;
    }
  }
}

// The same for any number of terms: four at a time.
template <typename R, bool kComplex>
void Combine(R* out, const R* const* srcs, const R* coefs, int64_t nterms,
             int64_t n) {
  const int64_t w = kComplex ? 2 : 1;
  switch (nterms) {
    case 1:
      return CombineFixed<R, kComplex, 1>(out, srcs, coefs, n);
    case 2:
      return CombineFixed<R, kComplex, 2>(out, srcs, coefs, n);
    case 3:
      return CombineFixed<R, kComplex, 3>(out, srcs, coefs, n);
    default:
      break;
  }
  CombineFixed<R, kComplex, 4>(out, srcs, coefs, n);
  for (int64_t t = 4; t < nterms;
       t += 3) {  // out ← 1·out + the next (up to) three terms
    const int64_t more = std::min<int64_t>(3, nterms - t);
    const R* sources[4] = {out};
    R c[8] = {R(1), R(0)};
    for (int64_t k = 0; k < more; ++k) {
      sources[1 + k] = srcs[t + k];
      std::copy(coefs + (t + k) * w, coefs + (t + k + 1) * w, c + (k + 1) * w);
    }
    switch (more) {
      case 1:
        CombineFixed<R, kComplex, 2>(out, sources, c, n);
        break;
      case 2:
        CombineFixed<R, kComplex, 3>(out, sources, c, n);
        break;
      default:
        CombineFixed<R, kComplex, 4>(out, sources, c, n);
        break;
    }
  }
}

// What one call computes, in the units that threads take: (batch entry, chunk).
struct Program {
  ffi::DataType dtype;
  int64_t width;  // scalars of R per element (2 for complex)
  int64_t n_inputs, n_outputs, n_terms, n_dots, length, chunks;
  ffi::Span<const int64_t> counts, terms, dots;
  const char* coefficients;         // batch × T elements
  std::vector<const char*> inputs;  // batch × length elements each
  std::vector<char*> outputs;
  char* dot_results;                       // batch × D elements
  std::vector<std::complex<double>> sums;  // [unit × D + dot]

  int64_t ElementBytes() const {
    return static_cast<int64_t>(ffi::ByteWidth(dtype));
  }

  // Whether new vector j may be stored as it is computed: unless its buffer
  // is an operand's (written over it) whose old value is still to be read in
  // the same block: by a later new vector, a dot, or its own terms past the
  // first four (Combine adds those to what it has already stored). Its
  // first four terms read each element before it is stored.
  std::vector<bool> direct;

  void FindDirectOutputs() {
    direct.assign(n_outputs, true);
    for (int64_t j = 0, own = 0; j < n_outputs; own += counts[j++]) {
      for (int64_t i = 0; i < n_inputs; ++i) {
        if (inputs[i] != outputs[j]) continue;
        for (int64_t t = own + std::min<int64_t>(4, counts[j]); t < n_terms;
             ++t) {
          direct[j] = direct[j] && terms[t] != i;
        }
        for (int64_t d : dots) direct[j] = direct[j] && d != i;
      }
    }
  }

  // Block by block: the new values (into their output, or a block-sized
  // scratch when that would clobber a value still to be read), the dots on
  // them, then the stores from the scratch.
  template <typename R, bool kComplex>
  void Run(int64_t unit) {
    const int64_t entry = unit / chunks, first = (unit % chunks) * kChunk;
    const int64_t bytes = ElementBytes();
    const R* coefs =
        reinterpret_cast<const R*>(coefficients + entry * n_terms * bytes);
    std::vector<R> scratch(n_outputs * kBlock * width);
    std::vector<const R*> srcs(n_terms);
    std::vector<vec::ComplexCascade> cascades(n_dots);
    auto target = [&](int64_t j, int64_t b) -> R* {
      if (direct[j])
        return reinterpret_cast<R*>(outputs[j] + (entry * length + b) * bytes);
      return scratch.data() + j * kBlock * width;
    };
    // L[i] at the block starting at element b.
    auto at = [&](int64_t i, int64_t b) -> const R* {
      if (i < n_inputs)
        return reinterpret_cast<const R*>(inputs[i] +
                                          (entry * length + b) * bytes);
      return target(i - n_inputs, b);
    };
    const int64_t end = std::min(first + kChunk, length);
    for (int64_t b = first; b < end; b += kBlock) {
      const int64_t count = std::min(kBlock, end - b);
      for (int64_t t = 0; t < n_terms; ++t) srcs[t] = at(terms[t], b);
      for (int64_t j = 0, t0 = 0; j < n_outputs; t0 += counts[j++]) {
        Combine<R, kComplex>(target(j, b), srcs.data() + t0, coefs + t0 * width,
                             counts[j], count * width);
      }
      for (int64_t d = 0; d < n_dots; ++d) {
        cascades[d].Add(vec::BlockDot(dtype, at(dots[2 * d], b),
                                      at(dots[2 * d + 1], b), 0, count));
      }
      for (int64_t j = 0; j < n_outputs; ++j) {
        if (!direct[j]) {
          std::memcpy(outputs[j] + (entry * length + b) * bytes,
                      scratch.data() + j * kBlock * width, count * bytes);
        }
      }
    }
    for (int64_t d = 0; d < n_dots; ++d)
      sums[unit * n_dots + d] = cascades[d].Total();
  }

  void RunUnit(int64_t unit);
};

// The kernels compiled for AVX-512 and AVX2 beside the baseline, chosen when
// the library loads (XLA's own fusions use the host's vector width too).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    __GNUC__ >= 11
#define DL_VECTOR_CLONES                                                       \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), \
                 flatten))
#else
#define DL_VECTOR_CLONES
#endif

DL_VECTOR_CLONES void RunUnitOf(Program& p, int64_t unit) {
  switch (p.dtype) {
    case ffi::DataType::F32:
      p.Run<float, false>(unit);
      break;
    case ffi::DataType::F64:
      p.Run<double, false>(unit);
      break;
    case ffi::DataType::C64:
      p.Run<float, true>(unit);
      break;
    default:
      p.Run<double, true>(unit);
      break;
  }
}

void Program::RunUnit(int64_t unit) { RunUnitOf(*this, unit); }

ffi::Error Invalid(const char* what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("distlinalg_fused_update: ") + what);
}

}  // namespace

ffi::Error FusedUpdateImpl(ffi::ThreadPool pool,
                           ffi::Span<const int64_t> counts,
                           ffi::Span<const int64_t> terms,
                           ffi::Span<const int64_t> dots,
                           ffi::RemainingArgs args, ffi::RemainingRets rets) {
  Program p;
  p.counts = counts;
  p.terms = terms;
  p.dots = dots;
  p.n_outputs = static_cast<int64_t>(counts.size());
  p.n_terms = static_cast<int64_t>(terms.size());
  p.n_dots = static_cast<int64_t>(dots.size()) / 2;
  p.n_inputs = static_cast<int64_t>(args.size()) - 1;
  if (p.n_outputs < 1 || p.n_outputs > kMaxOutputs || p.n_inputs < 1 ||
      static_cast<int64_t>(rets.size()) != p.n_outputs + 1 ||
      dots.size() % 2 != 0) {
    return Invalid(
        "expected coefficients, at least one vector, 1 to 8 outputs and one "
        "result per output plus the dots");
  }
  int64_t total = 0;
  for (int64_t j = 0; j < p.n_outputs; ++j) {
    if (counts[j] < 1) return Invalid("every output needs a term");
    for (int64_t t = total; t < total + counts[j] && t < p.n_terms; ++t) {
      if (terms[t] < 0 || terms[t] >= p.n_inputs + j)
        return Invalid("a term refers to no operand or earlier output");
    }
    total += counts[j];
  }
  if (total != p.n_terms)
    return Invalid("counts do not add up to the number of terms");
  for (int64_t i : dots) {
    if (i < 0 || i >= p.n_inputs + p.n_outputs)
      return Invalid("a dot refers to no operand or output");
  }
  auto coefficients = args.get<ffi::AnyBuffer>(0);
  if (coefficients.has_error()) return coefficients.error();
  p.dtype = coefficients->element_type();
  if (!vec::IsVectorDtype(p.dtype))
    return Invalid("dtype must be float32, float64, complex64 or complex128");
  p.width =
      (p.dtype == ffi::DataType::C64 || p.dtype == ffi::DataType::C128) ? 2 : 1;
  const int64_t batch =
      static_cast<int64_t>(coefficients->element_count()) / p.n_terms;
  if (batch * p.n_terms !=
      static_cast<int64_t>(coefficients->element_count())) {
    return Invalid("coefficients must hold batch × T elements");
  }
  p.coefficients = static_cast<const char*>(coefficients->untyped_data());
  int64_t size = -1;
  auto check_vector = [&](const ffi::AnyBuffer& v) {
    if (size < 0) size = static_cast<int64_t>(v.element_count());
    return v.element_type() == p.dtype &&
           static_cast<int64_t>(v.element_count()) == size;
  };
  for (int64_t i = 0; i < p.n_inputs; ++i) {
    auto v = args.get<ffi::AnyBuffer>(1 + i);
    if (v.has_error()) return v.error();
    if (!check_vector(*v))
      return Invalid(
          "vectors must share one dtype (the coefficients') and one size");
    p.inputs.push_back(static_cast<const char*>(v->untyped_data()));
  }
  for (int64_t j = 0; j < p.n_outputs; ++j) {
    auto out = rets.get<ffi::AnyBuffer>(j);
    if (out.has_error()) return out.error();
    if (!check_vector(**out))
      return Invalid("outputs must have the vectors' dtype and size");
    p.outputs.push_back(static_cast<char*>((*out)->untyped_data()));
  }
  auto dot_results = rets.get<ffi::AnyBuffer>(p.n_outputs);
  if (dot_results.has_error()) return dot_results.error();
  if ((*dot_results)->element_type() != p.dtype ||
      static_cast<int64_t>((*dot_results)->element_count()) !=
          batch * p.n_dots) {
    return Invalid(
        "the dots result must hold batch × D elements of the vectors' dtype");
  }
  p.dot_results = static_cast<char*>((*dot_results)->untyped_data());
  p.length = batch > 0 ? size / batch : 0;
  if (p.length * batch != size)
    return Invalid("the vectors' size must be a multiple of the batch");
  p.chunks = (p.length + kChunk - 1) / kChunk;
  const int64_t units = batch * p.chunks;
  p.sums.assign(units * p.n_dots, {});
  p.FindDirectOutputs();
  vec::ParallelFor(pool, units, [&p](int64_t unit) { p.RunUnit(unit); });

  const int64_t bytes = p.ElementBytes();
  for (int64_t e = 0; e < batch; ++e) {
    for (int64_t d = 0; d < p.n_dots; ++d) {
      vec::ComplexCascade sum;
      for (int64_t c = 0; c < p.chunks; ++c)
        sum.Add(p.sums[(e * p.chunks + c) * p.n_dots + d]);
      vec::StoreScalar(p.dtype, p.dot_results + (e * p.n_dots + d) * bytes,
                       sum.Total());
    }
  }
  return ffi::Error::Success();
}

}  // namespace distlinalg

XLA_FFI_DEFINE_HANDLER_SYMBOL(DlFusedUpdate, distlinalg::FusedUpdateImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Attr<xla::ffi::Span<const int64_t>>("counts")
                                  .Attr<xla::ffi::Span<const int64_t>>("terms")
                                  .Attr<xla::ffi::Span<const int64_t>>("dots")
                                  .RemainingArgs()
                                  .RemainingRets());
