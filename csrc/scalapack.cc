// ScaLAPACK (Intel MKL's, from the `mkl` PyPI wheel) as XLA FFI handlers:
// Cholesky solve (p?potrf + p?potrs), LU solve (p?gesv) and the Hermitian
// eigensolver (p?syevd / p?heevd) on a matrix that distlinalg holds by rows.
//
// Layout. Rank r holds rows [s_r, s_{r+1}) of the N x N matrix as a row-major
// (n_r, N) buffer; the split is arbitrary (a rank may hold none). ScaLAPACK
// wants a 2-D block-cyclic column-major layout on a BLACS grid. A row split
// of uneven sizes has no block-cyclic descriptor, so p?gemr2d cannot take it:
// the handlers move the data themselves, one MPI_Alltoallv per column panel
// each way (see kPanels), on a private duplicate of the communicator
// (ScaLAPACK's and our messages never meet the user's). Memory per rank is
// O(N^2 / P): this rank's rows, its block-cyclic pieces and one panel's
// exchange buffers.
//
// Loading. Nothing here links MKL: the extension builds and imports without
// it. distlinalg/linalg/_scalapack.py finds the wheel's libraries and calls
// LoadScalapack with their paths; the symbols are then looked up by name.
// MKL's BLACS references MPI symbols it does not link (it expects the MPI of
// the program to be global), and MKL's core, threading and interface layers
// reference each other, so: libmpi is promoted to RTLD_GLOBAL first, then
// every MKL library is opened RTLD_LAZY | RTLD_GLOBAL in dependency order.
//
// Ordering. The handlers take and return the MPI token like every other
// distlinalg call, so a solve is ordered with the program's collectives.
// BLACS is not thread-safe, so one process runs one ScaLAPACK call at a time
// (a process-wide lock; two threads driving ScaLAPACK on different
// communicators at once would have to take it in the same order on every
// rank, which distlinalg's one-thread-per-communicator rule already asks).
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <complex>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "scalapack.h"

namespace distlinalg {
namespace scalapack {
namespace {

// ---------------------------------------------------------------------------
// The routines, by their Fortran names (MKL's lp64 interface: every argument
// by pointer, 32-bit integers). Data pointers are void* so that one type
// serves the four precisions. MKL reads only the first character of the
// character arguments, so the hidden Fortran string lengths are not passed
// (MKL's own C prototypes, mkl_scalapack.h, omit them too).
using Potrf = void(const char* uplo, const int* n, void* a, const int* ia,
                   const int* ja, const int* desca, int* info);
using Potrs = void(const char* uplo, const int* n, const int* nrhs,
                   const void* a, const int* ia, const int* ja,
                   const int* desca, void* b, const int* ib, const int* jb,
                   const int* descb, int* info);
using Gesv = void(const int* n, const int* nrhs, void* a, const int* ia,
                  const int* ja, const int* desca, int* ipiv, void* b,
                  const int* ib, const int* jb, const int* descb, int* info);
using Syevd = void(const char* jobz, const char* uplo, const int* n, void* a,
                   const int* ia, const int* ja, const int* desca, void* w,
                   void* z, const int* iz, const int* jz, const int* descz,
                   void* work, const int* lwork, int* iwork, const int* liwork,
                   int* info);
using Heevd = void(const char* jobz, const char* uplo, const int* n, void* a,
                   const int* ia, const int* ja, const int* desca, void* w,
                   void* z, const int* iz, const int* jz, const int* descz,
                   void* work, const int* lwork, void* rwork, const int* lrwork,
                   int* iwork, const int* liwork, int* info);

// Precisions by index: s, d, c, z.
enum Precision : int { kS = 0, kD = 1, kC = 2, kZ = 3 };
constexpr char kLetters[] = {'s', 'd', 'c', 'z'};

struct Api {
  bool loaded = false;
  std::string error;  // why not (after a failed load)
  std::vector<void*> handles;
  // BLACS (C interface).
  int (*sys2blacs)(MPI_Comm) = nullptr;
  void (*gridinit)(int*, const char*, int, int) = nullptr;
  void (*gridinfo)(int, int*, int*, int*, int*) = nullptr;
  void (*gridexit)(int) = nullptr;
  void (*free_handle)(int) = nullptr;
  // ScaLAPACK, by precision.
  Potrf* potrf[4] = {};
  Potrs* potrs[4] = {};
  Gesv* gesv[4] = {};
  Syevd* syevd[2] = {};  // s, d
  Heevd* heevd[2] = {};  // c, z
};

Api& TheApi() {
  static Api api;
  return api;
}
std::mutex& LoadMutex() {
  static std::mutex m;
  return m;
}
// One ScaLAPACK call per process at a time (BLACS is not thread-safe).
std::mutex& CallMutex() {
  static std::mutex m;
  return m;
}

void* Find(const Api& api, const std::string& name) {
  // The most recently opened library first: ScaLAPACK, then BLACS, ...
  for (auto it = api.handles.rbegin(); it != api.handles.rend(); ++it) {
    if (void* p = dlsym(*it, name.c_str())) return p;
  }
  return nullptr;
}

template <typename F>
bool Bind(const Api& api, const std::string& name, F** out,
          std::string* missing) {
  *out = reinterpret_cast<F*>(Find(api, name));
  if (*out == nullptr) *missing += (missing->empty() ? "" : ", ") + name;
  return *out != nullptr;
}

// The libmpi this extension calls, reopened RTLD_GLOBAL (RTLD_NOLOAD: it is
// loaded already) so that the BLACS resolves its MPI symbols against it.
std::string PromoteMpi() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&MPI_Comm_rank), &info) == 0 ||
      info.dli_fname == nullptr) {
    return "could not find the MPI library's file (dladdr of MPI_Comm_rank "
           "failed)";
  }
  if (dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD) == nullptr) {
    const char* e = dlerror();
    return std::string("could not make ") + info.dli_fname +
           " global: " + (e ? e : "dlopen failed");
  }
  return "";
}

// ---------------------------------------------------------------------------
// Grids. Per communicator (an MPI attribute on it, so that a freed
// communicator whose handle MPI reuses never finds a stale entry): a private
// duplicate for the exchanges and the BLACS system handle made from it, and
// one BLACS context per grid shape.
struct Grid {
  int ctxt = -1;
  int nprow = 0, npcol = 0, myrow = -1, mycol = -1;
};

struct CommState {
  MPI_Comm dup = MPI_COMM_NULL;
  int system = -1;  // BLACS system handle of `dup`
  std::map<std::pair<int, int>, Grid> grids;
};

int StateKeyval();

int DeleteState(MPI_Comm, int, void* value, void*) {
  auto* state = static_cast<CommState*>(value);
  const Api& api = TheApi();
  std::lock_guard<std::mutex> lock(
      CallMutex());  // (BLACS: one thread at a time)
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && api.loaded) {
    for (auto& entry : state->grids) api.gridexit(entry.second.ctxt);
    if (state->system >= 0) api.free_handle(state->system);
    MPI_Comm_free(&state->dup);
  }
  delete state;
  return MPI_SUCCESS;
}

int StateKeyval() {
  static int keyval = [] {
    int k = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, DeleteState, &k, nullptr);
    return k;
  }();
  return keyval;
}

// The state of `comm`, made on first use (collective over `comm`: every rank
// reaches its first ScaLAPACK call on `comm` at the same point of the program).
ffi::Error StateOf(MPI_Comm comm, CommState** out) {
  int flag = 0;
  void* value = nullptr;
  DL_MPI_CHECK("scalapack (attribute)",
               MPI_Comm_get_attr(comm, StateKeyval(), &value, &flag));
  if (flag) {
    *out = static_cast<CommState*>(value);
    return ffi::Error::Success();
  }
  auto state = std::make_unique<CommState>();
  DL_MPI_CHECK("scalapack (MPI_Comm_dup)", MPI_Comm_dup(comm, &state->dup));
  MPI_Comm_set_errhandler(state->dup, MPI_ERRORS_RETURN);
  state->system = TheApi().sys2blacs(state->dup);
  DL_MPI_CHECK("scalapack (attribute)",
               MPI_Comm_set_attr(comm, StateKeyval(), state.get()));
  *out = state.release();
  return ffi::Error::Success();
}

ffi::Error GridOf(CommState* state, int nprow, int npcol, const Grid** out) {
  auto key = std::make_pair(nprow, npcol);
  auto it = state->grids.find(key);
  if (it == state->grids.end()) {
    Grid g;
    g.ctxt = state->system;
    // Row-major process order: the process at (pr, pc) is rank pr * npcol + pc.
    TheApi().gridinit(&g.ctxt, "Row", nprow, npcol);
    int rows = 0, cols = 0;
    TheApi().gridinfo(g.ctxt, &rows, &cols, &g.myrow, &g.mycol);
    int rank = 0;
    MPI_Comm_rank(state->dup, &rank);
    if (rows != nprow || cols != npcol || g.myrow != rank / npcol ||
        g.mycol != rank % npcol) {
      Text msg;
      msg << "distlinalg: the BLACS grid " << nprow << "x" << npcol
          << " came out as " << rows << "x" << cols << " with this rank ("
          << rank << ") at (" << g.myrow << ", " << g.mycol
          << "), not in row-major order";
      return ffi::Error(ffi::ErrorCode::kInternal, msg.str());
    }
    g.nprow = nprow;
    g.npcol = npcol;
    it = state->grids.emplace(key, g).first;
  }
  *out = &it->second;
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Block-cyclic index arithmetic (block nb, source process 0).
inline int64_t Owner(int64_t i, int64_t nb, int nprocs) {
  return (i / nb) % nprocs;
}
inline int64_t Local(int64_t i, int64_t nb, int nprocs) {
  return (i / (nb * nprocs)) * nb + i % nb;
}
// ScaLAPACK's NUMROC: how many of n indices process `iproc` of `nprocs` owns.
int64_t Numroc(int64_t n, int64_t nb, int iproc, int nprocs) {
  const int64_t blocks = n / nb;
  int64_t count = (blocks / nprocs) * nb;
  const int64_t extra = blocks % nprocs;
  if (iproc < extra) {
    count += nb;
  } else if (iproc == extra) {
    count += n % nb;
  }
  return count;
}

// How a (rows x cols) global matrix is split: by rows over the ranks
// (`starts`, row-major pieces) and block-cyclically over the grid
// (column-major local pieces of leading dimension `lld`).
struct Layout {
  int64_t rows = 0, cols = 0, nb = 0;
  const std::vector<int64_t>* starts = nullptr;  // P + 1 row offsets
  const Grid* grid = nullptr;
  int rank = 0;
  int64_t mloc = 0, nloc = 0, lld = 1;
  std::vector<std::vector<int64_t>>
      cols_of;  // global columns of each process column

  Layout(int64_t rows_, int64_t cols_, int64_t nb_,
         const std::vector<int64_t>& starts_, const Grid& grid_, int rank_)
      : rows(rows_),
        cols(cols_),
        nb(nb_),
        starts(&starts_),
        grid(&grid_),
        rank(rank_) {
    mloc = Numroc(rows, nb, grid->myrow, grid->nprow);
    nloc = Numroc(cols, nb, grid->mycol, grid->npcol);
    lld = std::max<int64_t>(1, mloc);
    cols_of.resize(grid->npcol);
    for (int64_t j = 0; j < cols; ++j)
      cols_of[Owner(j, nb, grid->npcol)].push_back(j);
  }
  int nprocs() const { return grid->nprow * grid->npcol; }
  int64_t first(int r) const { return (*starts)[r]; }
  int64_t last(int r) const { return (*starts)[r + 1]; }
  int64_t local_size() const { return std::max<int64_t>(1, lld * nloc); }
  void desc(int out[9]) const {
    out[0] = 1;  // dense matrix
    out[1] = grid->ctxt;
    out[2] = static_cast<int>(rows);
    out[3] = static_cast<int>(cols);
    out[4] = out[5] = static_cast<int>(nb);
    out[6] = out[7] = 0;  // first row and column on process (0, 0)
    out[8] = static_cast<int>(lld);
  }
};

// An error on every rank when `bad` holds on any: the ranks' pieces differ in
// size, and a rank that stopped alone would leave the others waiting in the
// next exchange or inside ScaLAPACK.
ffi::Error Together(MPI_Comm dup, bool bad, const char* message) {
  int any = bad;
  DL_MPI_CHECK("scalapack (agreement)",
               MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MAX, dup));
  if (!any) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    std::string("distlinalg: ScaLAPACK engine: ") + message);
}

// Element counts and offsets of an exchange as MPI takes them (int); false
// when they do not fit.
bool IntCounts(const std::vector<int64_t>& counts, std::vector<int>* c,
               std::vector<int>* d) {
  c->resize(counts.size());
  d->resize(counts.size());
  int64_t offset = 0;
  for (size_t q = 0; q < counts.size(); ++q) {
    if (offset + counts[q] > std::numeric_limits<int>::max()) return false;
    (*c)[q] = static_cast<int>(counts[q]);
    (*d)[q] = static_cast<int>(offset);
    offset += counts[q];
  }
  return true;
}

ffi::Error Exchange(MPI_Comm user_comm, MPI_Comm dup, const void* send,
                    const std::vector<int64_t>& send_counts, void* recv,
                    const std::vector<int64_t>& recv_counts,
                    MPI_Datatype type) {
  std::vector<int> sc, sd, rc, rd;
  const bool fits =
      IntCounts(send_counts, &sc, &sd) && IntCounts(recv_counts, &rc, &rd);
  DL_CHECK(Together(
      dup, !fits,
      "the redistribution exceeds 2^31 elements on some rank; use more ranks"));
  int code = MPI_SUCCESS;
  if (!GlobalSettings().cancellable_collectives) {
    code = MPI_Alltoallv(send, sc.data(), sd.data(), type, recv, rc.data(),
                         rd.data(), type, dup);
  } else {
    MPI_Request request = MPI_REQUEST_NULL;
    code = MPI_Ialltoallv(send, sc.data(), sd.data(), type, recv, rc.data(),
                          rd.data(), type, dup, &request);
    if (code == MPI_SUCCESS) {
      DL_CHECK(WaitOrCancel("scalapack (redistribution)", user_comm, 1,
                            &request, nullptr, &code));
    }
  }
  if (code != MPI_SUCCESS) return MpiError("scalapack (redistribution)", code);
  return ffi::Error::Success();
}

// The handlers' own memory (their block-cyclic pieces, workspaces and
// exchange buffers, beside the XLA buffers they read and write): live and
// high-water bytes of this process, for the benchmarks' accounting
// (scalapack_memory in Python). Calls are serialised by CallMutex, the
// atomics only keep a reader on another thread honest.
std::atomic<int64_t> live_bytes{0}, peak_bytes{0};

// A zero-filled array that counts itself in live_bytes / peak_bytes.
template <typename T>
class Buffer {
 public:
  explicit Buffer(int64_t n)
      : data_(static_cast<size_t>(std::max<int64_t>(1, n))) {
    const int64_t now = live_bytes += Bytes();
    int64_t peak = peak_bytes.load();
    while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
    }
  }
  ~Buffer() { live_bytes -= Bytes(); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }
  T& operator[](int64_t i) { return data_[static_cast<size_t>(i)]; }

 private:
  int64_t Bytes() const {
    return static_cast<int64_t>(data_.size() * sizeof(T));
  }
  std::vector<T> data_;
};

// The columns of `cols` (ascending) that lie in [c0, c1), as a range of
// positions in `cols`.
std::pair<int64_t, int64_t> ColumnsIn(const std::vector<int64_t>& cols,
                                      int64_t c0, int64_t c1) {
  auto lo = std::lower_bound(cols.begin(), cols.end(), c0);
  auto hi = std::lower_bound(lo, cols.end(), c1);
  return {lo - cols.begin(), hi - cols.begin()};
}

// Rows of every rank that this process row owns (its receive counts, per
// column).
std::vector<int64_t> RowsOwnedFrom(const Layout& L) {
  std::vector<int64_t> n(L.nprocs(), 0);
  for (int s = 0; s < L.nprocs(); ++s) {
    for (int64_t i = L.first(s); i < L.last(s); ++i)
      n[s] += Owner(i, L.nb, L.grid->nprow) == L.grid->myrow;
  }
  return n;
}

// The rows -> block-cyclic move (and back), one column panel at a time: the
// exchange buffers hold a panel (about 1/kPanels of this rank's share), not
// the whole matrix, so the move costs one more share (the block-cyclic
// piece) instead of three. Panels are whole block columns of every process
// column, and their number comes from N, nb and the grid only, so every rank
// takes part in the same exchanges.
constexpr int64_t kPanels = 8;

int64_t PanelWidth(const Layout& L) {
  const int64_t unit = L.nb * L.grid->npcol;
  const int64_t per_panel = (L.cols + kPanels - 1) / kPanels;
  return std::max<int64_t>(1, (per_panel + unit - 1) / unit) * unit;
}

// This rank's rows (row-major, rows [first, last) x cols) -> its
// block-cyclic piece (column-major, lld). For each panel every rank sends,
// for each grid process, the elements it owns in row order, columns
// ascending within a row; the receiver walks the sender's rows in the same
// order.
template <typename T>
ffi::Error RowsToCyclic(const Layout& L, const T* rows_data, T* local,
                        MPI_Comm user_comm, MPI_Comm dup, MPI_Datatype type) {
  const Grid& g = *L.grid;
  const int P = L.nprocs();
  const int64_t r0 = L.first(L.rank), r1 = L.last(L.rank);
  std::vector<int64_t> rows_on(g.nprow, 0);
  for (int64_t i = r0; i < r1; ++i) ++rows_on[Owner(i, L.nb, g.nprow)];
  const std::vector<int64_t> owned_from = RowsOwnedFrom(L);
  const int64_t width = PanelWidth(L);
  for (int64_t c0 = 0; c0 < L.cols; c0 += width) {
    std::vector<std::pair<int64_t, int64_t>> run(g.npcol);
    for (int pc = 0; pc < g.npcol; ++pc)
      run[pc] = ColumnsIn(L.cols_of[pc], c0, std::min(L.cols, c0 + width));
    std::vector<int64_t> send_counts(P), offsets(P + 1, 0);
    for (int q = 0; q < P; ++q) {
      const auto& r = run[q % g.npcol];
      send_counts[q] = rows_on[q / g.npcol] * (r.second - r.first);
      offsets[q + 1] = offsets[q] + send_counts[q];
    }
    Buffer<T> send(offsets[P]);
    for (int64_t i = r0; i < r1; ++i) {
      const T* row = rows_data + (i - r0) * L.cols;
      const int pr = static_cast<int>(Owner(i, L.nb, g.nprow));
      for (int pc = 0; pc < g.npcol; ++pc) {
        int64_t& at = offsets[pr * g.npcol + pc];
        for (int64_t k = run[pc].first; k < run[pc].second; ++k)
          send[at++] = row[L.cols_of[pc][k]];
      }
    }
    const auto& mine = run[g.mycol];
    std::vector<int64_t> recv_counts(P);
    int64_t total = 0;
    for (int s = 0; s < P; ++s) {
      recv_counts[s] = owned_from[s] * (mine.second - mine.first);
      total += recv_counts[s];
    }
    Buffer<T> recv(total);
    DL_CHECK(Exchange(user_comm, dup, send.data(), send_counts, recv.data(),
                      recv_counts, type));
    int64_t at = 0;
    for (int s = 0; s < P; ++s) {
      for (int64_t i = L.first(s); i < L.last(s); ++i) {
        if (Owner(i, L.nb, g.nprow) != g.myrow) continue;
        T* dst = local + Local(i, L.nb, g.nprow);
        for (int64_t k = mine.first; k < mine.second; ++k)
          dst[Local(L.cols_of[g.mycol][k], L.nb, g.npcol) * L.lld] = recv[at++];
      }
    }
  }
  return ffi::Error::Success();
}

// The inverse: block-cyclic piece -> this rank's rows (row-major), by the
// same panels.
template <typename T>
ffi::Error CyclicToRows(const Layout& L, const T* local, T* rows_data,
                        MPI_Comm user_comm, MPI_Comm dup, MPI_Datatype type) {
  const Grid& g = *L.grid;
  const int P = L.nprocs();
  const int64_t r0 = L.first(L.rank), r1 = L.last(L.rank);
  std::vector<int64_t> rows_on(g.nprow, 0);
  for (int64_t i = r0; i < r1; ++i) ++rows_on[Owner(i, L.nb, g.nprow)];
  const std::vector<int64_t> owned_from = RowsOwnedFrom(L);
  const int64_t width = PanelWidth(L);
  for (int64_t c0 = 0; c0 < L.cols; c0 += width) {
    std::vector<std::pair<int64_t, int64_t>> run(g.npcol);
    for (int pc = 0; pc < g.npcol; ++pc)
      run[pc] = ColumnsIn(L.cols_of[pc], c0, std::min(L.cols, c0 + width));
    const auto& mine = run[g.mycol];
    std::vector<int64_t> send_counts(P);
    int64_t total = 0;
    for (int s = 0; s < P; ++s) {
      send_counts[s] = owned_from[s] * (mine.second - mine.first);
      total += send_counts[s];
    }
    Buffer<T> send(total);
    int64_t at = 0;
    for (int s = 0; s < P; ++s) {
      for (int64_t i = L.first(s); i < L.last(s); ++i) {
        if (Owner(i, L.nb, g.nprow) != g.myrow) continue;
        const T* src = local + Local(i, L.nb, g.nprow);
        for (int64_t k = mine.first; k < mine.second; ++k)
          send[at++] = src[Local(L.cols_of[g.mycol][k], L.nb, g.npcol) * L.lld];
      }
    }
    std::vector<int64_t> recv_counts(P), offsets(P + 1, 0);
    for (int q = 0; q < P; ++q) {
      const auto& r = run[q % g.npcol];
      recv_counts[q] = rows_on[q / g.npcol] * (r.second - r.first);
      offsets[q + 1] = offsets[q] + recv_counts[q];
    }
    Buffer<T> recv(offsets[P]);
    DL_CHECK(Exchange(user_comm, dup, send.data(), send_counts, recv.data(),
                      recv_counts, type));
    for (int64_t i = r0; i < r1; ++i) {
      T* row = rows_data + (i - r0) * L.cols;
      const int pr = static_cast<int>(Owner(i, L.nb, g.nprow));
      for (int pc = 0; pc < g.npcol; ++pc) {
        int64_t& from = offsets[pr * g.npcol + pc];
        for (int64_t k = run[pc].first; k < run[pc].second; ++k)
          row[L.cols_of[pc][k]] = recv[from++];
      }
    }
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
template <typename T>
struct Real {
  using type = T;
};
template <typename T>
struct Real<std::complex<T>> {
  using type = T;
};

template <typename T>
void FillNan(T* p, int64_t n) {
  using R = typename Real<T>::type;
  const R nan = std::numeric_limits<R>::quiet_NaN();
  if constexpr (std::is_same_v<T, R>) {
    std::fill(p, p + n, nan);
  } else {
    std::fill(p, p + n, T(nan, nan));
  }
}

ffi::Error Invalid(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    "distlinalg: ScaLAPACK engine: " + what);
}

// INFO of every rank -> one value: the most negative when any rank reports a
// bad argument (a negative INFO names the argument), else the largest (the
// first failing pivot / leading minor / eigenvalue, as ScaLAPACK reports it).
ffi::Error AgreeOnInfo(MPI_Comm dup, int* info) {
  int both[2] = {*info, -*info};
  DL_MPI_CHECK("scalapack (info)",
               MPI_Allreduce(MPI_IN_PLACE, both, 2, MPI_INT, MPI_MAX, dup));
  const int largest = both[0], smallest = -both[1];
  *info = smallest < 0 ? smallest : largest;
  return ffi::Error::Success();
}

struct Call {
  MPI_Comm comm;  // the user's communicator
  CommState* state = nullptr;
  const Grid* grid = nullptr;
  int rank = 0, size = 0;
  int64_t n = 0;
  std::vector<int64_t> starts;
};

ffi::Error Prepare(int64_t comm_handle, ffi::Span<const int64_t> sizes,
                   int64_t nprow, int64_t npcol, int64_t nb, int64_t my_rows,
                   int64_t n, Call* call) {
  const Api& api = TheApi();
  if (!api.loaded) {
    return ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        "distlinalg: the ScaLAPACK engine is not loaded (install the `mkl` "
        "package: `make scalapack`); " +
            api.error);
  }
  call->comm = CommFromKey(comm_handle);
  if (call->comm == MPI_COMM_NULL) return UnknownCommKey(comm_handle);
  MPI_Comm_rank(call->comm, &call->rank);
  MPI_Comm_size(call->comm, &call->size);
  if (static_cast<int64_t>(sizes.size()) != call->size) {
    return Invalid("sizes has " + std::to_string(sizes.size()) +
                   " entries for " + std::to_string(call->size) + " ranks");
  }
  call->starts.assign(call->size + 1, 0);
  for (int r = 0; r < call->size; ++r) {
    if (sizes[r] < 0) return Invalid("negative row count in sizes");
    call->starts[r + 1] = call->starts[r] + sizes[r];
  }
  if (call->starts[call->size] != n) {
    return Invalid("the row counts add up to " +
                   std::to_string(call->starts[call->size]) +
                   ", not N = " + std::to_string(n));
  }
  if (sizes[call->rank] != my_rows) {
    return Invalid("this rank holds " + std::to_string(my_rows) +
                   " rows, sizes says " + std::to_string(sizes[call->rank]));
  }
  if (nprow < 1 || npcol < 1 || nprow * npcol != call->size) {
    return Invalid("grid " + std::to_string(nprow) + "x" +
                   std::to_string(npcol) +
                   " does not have one process per rank (" +
                   std::to_string(call->size) + ")");
  }
  if (nb < 1) return Invalid("block size must be positive");
  if (n > std::numeric_limits<int>::max()) return Invalid("N exceeds 2^31 - 1");
  DL_CHECK(StateOf(call->comm, &call->state));
  DL_CHECK(GridOf(call->state, static_cast<int>(nprow), static_cast<int>(npcol),
                  &call->grid));
  call->n = n;
  return ffi::Error::Success();
}

int PrecisionOf(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return kS;
    case ffi::DataType::F64:
      return kD;
    case ffi::DataType::C64:
      return kC;
    case ffi::DataType::C128:
      return kZ;
    default:
      return -1;
  }
}

// A hash of everything every rank must agree on, for the signature check.
int64_t Fingerprint(std::initializer_list<int64_t> words,
                    ffi::Span<const int64_t> sizes) {
  uint64_t h = 1469598103934665603ULL;
  auto mix = [&](int64_t w) {
    for (int b = 0; b < 8; ++b)
      h = (h ^ ((static_cast<uint64_t>(w) >> (8 * b)) & 0xff)) *
          1099511628211ULL;
  };
  for (int64_t w : words) mix(w);
  for (int64_t s : sizes) mix(s);
  return static_cast<int64_t>(h & 0x7fffffffffffffffULL);
}

constexpr int kOne = 1;

// The first k (1-based) with U(k, k) zero or not finite among the diagonal
// entries of this process's piece of the LU factors, or 0. MKL's p?gesv
// (2026.2, blocks smaller than N) returns INFO = 0 for exactly singular
// matrices (a zero column) and divides by the zero pivot, and with one block
// it named the wrong pivot (5 for a zero last column of 37), so the engine
// reads the pivots itself; over the ranks the smallest is the answer.
template <typename T>
int FirstBadPivot(const Layout& L, const T* lu) {
  const Grid& g = *L.grid;
  for (int64_t k = 0; k < L.rows; ++k) {
    if (Owner(k, L.nb, g.nprow) != g.myrow ||
        Owner(k, L.nb, g.npcol) != g.mycol)
      continue;
    const T u = lu[Local(k, L.nb, g.nprow) + Local(k, L.nb, g.npcol) * L.lld];
    if (u == T(0) || !std::isfinite(std::abs(u)))
      return static_cast<int>(k + 1);
  }
  return 0;
}

// kind 0: Cholesky (p?potrf + p?potrs, lower triangle); 1: LU (p?gesv).
template <typename T>
ffi::Error SolveTyped(const Call& c, int prec, int32_t kind, int64_t nb,
                      int64_t m, const T* a_rows, const T* b_rows, T* x_rows,
                      int32_t* info_out, MPI_Datatype type) {
  const Api& api = TheApi();
  const int64_t my_rows = c.starts[c.rank + 1] - c.starts[c.rank];
  Layout LA(c.n, c.n, nb, c.starts, *c.grid, c.rank);
  Layout LB(c.n, m, nb, c.starts, *c.grid, c.rank);
  Buffer<T> a(LA.local_size()), b(LB.local_size());
  DL_CHECK(RowsToCyclic(LA, a_rows, a.data(), c.comm, c.state->dup, type));
  DL_CHECK(RowsToCyclic(LB, b_rows, b.data(), c.comm, c.state->dup, type));
  int desca[9], descb[9];
  LA.desc(desca);
  LB.desc(descb);
  const int n = static_cast<int>(c.n), nrhs = static_cast<int>(m);
  int info = 0;
  if (kind == 0) {
    api.potrf[prec]("L", &n, a.data(), &kOne, &kOne, desca, &info);
    DL_CHECK(AgreeOnInfo(c.state->dup, &info));
    if (info == 0 && nrhs > 0) {
      api.potrs[prec]("L", &n, &nrhs, a.data(), &kOne, &kOne, desca, b.data(),
                      &kOne, &kOne, descb, &info);
      DL_CHECK(AgreeOnInfo(c.state->dup, &info));
    }
  } else {
    std::vector<int> ipiv(LA.mloc + nb);
    api.gesv[prec](&n, &nrhs, a.data(), &kOne, &kOne, desca, ipiv.data(),
                   b.data(), &kOne, &kOne, descb, &info);
    DL_CHECK(AgreeOnInfo(c.state->dup, &info));
    if (info >= 0) {
      int bad = FirstBadPivot(LA, a.data());
      if (bad == 0) bad = std::numeric_limits<int>::max();
      DL_MPI_CHECK(
          "scalapack (pivots)",
          MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MIN, c.state->dup));
      if (bad != std::numeric_limits<int>::max()) info = bad;
    }
  }
  // Every rank knows the same info, so all take part in the exchange or none.
  if (info == 0) {
    DL_CHECK(CyclicToRows(LB, b.data(), x_rows, c.comm, c.state->dup, type));
  } else {
    FillNan(x_rows, my_rows * m);
  }
  *info_out = info;
  return ffi::Error::Success();
}

// A workspace length for ScaLAPACK's 32-bit integers, or -1 when it does not
// fit.
int WorkLength(double query, double minimum) {
  const double n = std::max(query, minimum) * 1.01 +
                   16;  // (a margin over the query's rounding)
  return n < static_cast<double>(std::numeric_limits<int>::max())
             ? static_cast<int>(n)
             : -1;
}

constexpr const char* kWorkspaceTooLarge =
    "the eigensolver's workspace exceeds 2^31 elements on some rank; use more "
    "ranks";

template <typename T>
ffi::Error EighTyped(const Call& c, int prec, int64_t nb, const T* a_rows,
                     typename Real<T>::type* w, T* v_rows, int32_t* info_out,
                     MPI_Datatype type, MPI_Datatype real_type) {
  using R = typename Real<T>::type;
  const Api& api = TheApi();
  const int64_t my_rows = c.starts[c.rank + 1] - c.starts[c.rank];
  Layout L(c.n, c.n, nb, c.starts, *c.grid, c.rank);
  Buffer<T> a(L.local_size()), z(L.local_size());
  DL_CHECK(RowsToCyclic(L, a_rows, a.data(), c.comm, c.state->dup, type));
  int desc[9];
  L.desc(desc);
  const int n = static_cast<int>(c.n);
  int info = 0;
  // Workspace sizes: ScaLAPACK's query (lwork = -1), never below the
  // documented minima (some versions' queries come out short for iwork and
  // rwork).
  const int64_t np = L.mloc, nq = L.nloc;
  const int liwork_min = 7 * n + 8 * c.grid->npcol + 2;
  int minus1 = -1, liwork_q = 0;
  if constexpr (std::is_same_v<T, R>) {
    R work_q = 0;
    api.syevd[prec == kS ? 0 : 1]("V", "L", &n, a.data(), &kOne, &kOne, desc, w,
                                  z.data(), &kOne, &kOne, desc, &work_q,
                                  &minus1, &liwork_q, &minus1, &info);
    DL_CHECK(
        AgreeOnInfo(c.state->dup, &info));  // (every rank goes on, or none)
    if (info == 0) {
      const int lwork = WorkLength(work_q, 1.0 + 6.0 * n + 2.0 * np * nq);
      DL_CHECK(Together(c.state->dup, lwork < 0, kWorkspaceTooLarge));
      const int liwork = std::max(liwork_q, liwork_min);
      Buffer<R> work(lwork);
      Buffer<int> iwork(liwork);
      api.syevd[prec == kS ? 0 : 1](
          "V", "L", &n, a.data(), &kOne, &kOne, desc, w, z.data(), &kOne, &kOne,
          desc, work.data(), &lwork, iwork.data(), &liwork, &info);
    }
  } else {
    T work_q = 0;
    R rwork_q = 0;
    api.heevd[prec == kC ? 0 : 1](
        "V", "L", &n, a.data(), &kOne, &kOne, desc, w, z.data(), &kOne, &kOne,
        desc, &work_q, &minus1, &rwork_q, &minus1, &liwork_q, &minus1, &info);
    DL_CHECK(AgreeOnInfo(c.state->dup, &info));
    if (info == 0) {
      const int lwork = WorkLength(std::real(work_q), 1.0);
      const int lrwork = WorkLength(rwork_q, 1.0 + 9.0 * n + 3.0 * np * nq);
      DL_CHECK(
          Together(c.state->dup, lwork < 0 || lrwork < 0, kWorkspaceTooLarge));
      const int liwork = std::max(liwork_q, liwork_min);
      Buffer<T> work(lwork);
      Buffer<R> rwork(lrwork);
      Buffer<int> iwork(liwork);
      api.heevd[prec == kC ? 0 : 1]("V", "L", &n, a.data(), &kOne, &kOne, desc,
                                    w, z.data(), &kOne, &kOne, desc,
                                    work.data(), &lwork, rwork.data(), &lrwork,
                                    iwork.data(), &liwork, &info);
    }
  }
  DL_CHECK(AgreeOnInfo(c.state->dup, &info));
  if (info == 0) {
    DL_CHECK(CyclicToRows(L, z.data(), v_rows, c.comm, c.state->dup, type));
    // W is global output (every grid process has it); rank 0's copy makes
    // it bitwise identical everywhere whatever the reduction order was.
    DL_MPI_CHECK("scalapack (eigenvalues)",
                 MPI_Bcast(w, n, real_type, 0, c.state->dup));
  } else {
    FillNan(v_rows, my_rows * c.n);
    FillNan(w, c.n);
  }
  *info_out = info;
  return ffi::Error::Success();
}

}  // namespace

// ---------------------------------------------------------------------------
std::string Load(const std::vector<std::string>& paths) {
  std::lock_guard<std::mutex> lock(LoadMutex());
  Api& api = TheApi();
  if (api.loaded) return "";
  api.error.clear();
  std::string e = PromoteMpi();
  if (!e.empty()) return api.error = e;
  for (const std::string& path : paths) {
    dlerror();
    void* h = dlopen(path.c_str(), RTLD_LAZY | RTLD_GLOBAL);
    if (h == nullptr) {
      const char* why = dlerror();
      return api.error = "could not load " + path + ": " +
                         (why ? why : "dlopen failed");
    }
    api.handles.push_back(h);
  }
  std::string missing;
  Bind(api, "Csys2blacs_handle", &api.sys2blacs, &missing);
  Bind(api, "Cblacs_gridinit", &api.gridinit, &missing);
  Bind(api, "Cblacs_gridinfo", &api.gridinfo, &missing);
  Bind(api, "Cblacs_gridexit", &api.gridexit, &missing);
  Bind(api, "Cfree_blacs_system_handle", &api.free_handle, &missing);
  for (int p = 0; p < 4; ++p) {
    const std::string x(1, kLetters[p]);
    Bind(api, "p" + x + "potrf_", &api.potrf[p], &missing);
    Bind(api, "p" + x + "potrs_", &api.potrs[p], &missing);
    Bind(api, "p" + x + "gesv_", &api.gesv[p], &missing);
  }
  Bind(api, "pssyevd_", &api.syevd[0], &missing);
  Bind(api, "pdsyevd_", &api.syevd[1], &missing);
  Bind(api, "pcheevd_", &api.heevd[0], &missing);
  Bind(api, "pzheevd_", &api.heevd[1], &missing);
  if (!missing.empty()) return api.error = "the libraries lack " + missing;
  api.loaded = true;
  return "";
}

bool Loaded() { return TheApi().loaded; }

std::pair<int64_t, int64_t> Memory(bool reset_peak) {
  const std::pair<int64_t, int64_t> now{live_bytes.load(), peak_bytes.load()};
  if (reset_peak) peak_bytes = live_bytes.load();
  return now;
}

// ---------------------------------------------------------------------------
ffi::Error SolveImpl(ffi::Token, ffi::AnyBuffer a, ffi::AnyBuffer b,
                     ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> x,
                     ffi::Result<ffi::BufferR0<ffi::S32>> info,
                     int64_t comm_handle, ffi::Span<const int64_t> sizes,
                     int32_t kind, int64_t nprow, int64_t npcol, int64_t nb,
                     ffi::RunId run, int64_t site) {
  MpiLock mpi_lock;
  DL_CHECK(CheckNotFinalized("scalapack_solve"));
  const ffi::DataType dtype = a.element_type();
  const int prec = PrecisionOf(dtype);
  if (prec < 0 || b.element_type() != dtype) {
    return Invalid(
        std::string(
            "solves take float32, float64, complex64 or complex128 with b of "
            "the dtype of A, got ") +
        DtypeName(dtype) + " and " + DtypeName(b.element_type()));
  }
  auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || bd[0] != ad[0]) {
    return Invalid("A must be (n_r, N) and b (n_r, m)");
  }
  const int64_t n = ad[1], m = bd[1];
  DL_COMM_OF_KEY(comm, comm_handle);
  CallRecord record(kind == 0 ? "scalapack_potrf_solve" : "scalapack_gesv",
                    comm, dtype, ad[0] * n, -1);
  DL_CHECKED_CALL(record,
                  Signature("scalapack")
                      .Flag(Fingerprint({1, kind, static_cast<int64_t>(dtype),
                                         n, m, nprow, npcol, nb},
                                        sizes)),
                  CheckCollective(dl_sig_, comm));
  std::lock_guard<std::mutex> call_lock(CallMutex());
  Call c;
  DL_CHECK(Prepare(comm_handle, sizes, nprow, npcol, nb, ad[0], n, &c));
  int32_t* info_out = info->typed_data();
  if (n == 0) {
    *info_out = 0;
    return ffi::Error::Success();
  }
  switch (prec) {
    case kS:
      return SolveTyped(
          c, prec, kind, nb, m, static_cast<const float*>(a.untyped_data()),
          static_cast<const float*>(b.untyped_data()),
          static_cast<float*>(x->untyped_data()), info_out, MPI_FLOAT);
    case kD:
      return SolveTyped(
          c, prec, kind, nb, m, static_cast<const double*>(a.untyped_data()),
          static_cast<const double*>(b.untyped_data()),
          static_cast<double*>(x->untyped_data()), info_out, MPI_DOUBLE);
    case kC:
      return SolveTyped(
          c, prec, kind, nb, m,
          static_cast<const std::complex<float>*>(a.untyped_data()),
          static_cast<const std::complex<float>*>(b.untyped_data()),
          static_cast<std::complex<float>*>(x->untyped_data()), info_out,
          MPI_C_FLOAT_COMPLEX);
    default:
      return SolveTyped(
          c, prec, kind, nb, m,
          static_cast<const std::complex<double>*>(a.untyped_data()),
          static_cast<const std::complex<double>*>(b.untyped_data()),
          static_cast<std::complex<double>*>(x->untyped_data()), info_out,
          MPI_C_DOUBLE_COMPLEX);
  }
}

ffi::Error EighImpl(ffi::Token, ffi::AnyBuffer a, ffi::Result<ffi::Token>,
                    ffi::Result<ffi::AnyBuffer> w,
                    ffi::Result<ffi::AnyBuffer> v,
                    ffi::Result<ffi::BufferR0<ffi::S32>> info,
                    int64_t comm_handle, ffi::Span<const int64_t> sizes,
                    int64_t nprow, int64_t npcol, int64_t nb, ffi::RunId run,
                    int64_t site) {
  MpiLock mpi_lock;
  DL_CHECK(CheckNotFinalized("scalapack_heevd"));
  const ffi::DataType dtype = a.element_type();
  const int prec = PrecisionOf(dtype);
  if (prec < 0) {
    return Invalid(
        std::string(
            "eigh takes float32, float64, complex64 or complex128, got ") +
        DtypeName(dtype));
  }
  auto ad = a.dimensions();
  if (ad.size() != 2) return Invalid("A must be (n_r, N)");
  const int64_t n = ad[1];
  DL_COMM_OF_KEY(comm, comm_handle);
  CallRecord record("scalapack_heevd", comm, dtype, ad[0] * n, -1);
  DL_CHECKED_CALL(
      record,
      Signature("scalapack")
          .Flag(Fingerprint(
              {2, static_cast<int64_t>(dtype), n, nprow, npcol, nb}, sizes)),
      CheckCollective(dl_sig_, comm));
  std::lock_guard<std::mutex> call_lock(CallMutex());
  Call c;
  DL_CHECK(Prepare(comm_handle, sizes, nprow, npcol, nb, ad[0], n, &c));
  int32_t* info_out = info->typed_data();
  if (n == 0) {
    *info_out = 0;
    return ffi::Error::Success();
  }
  switch (prec) {
    case kS:
      return EighTyped(c, prec, nb, static_cast<const float*>(a.untyped_data()),
                       static_cast<float*>(w->untyped_data()),
                       static_cast<float*>(v->untyped_data()), info_out,
                       MPI_FLOAT, MPI_FLOAT);
    case kD:
      return EighTyped(c, prec, nb,
                       static_cast<const double*>(a.untyped_data()),
                       static_cast<double*>(w->untyped_data()),
                       static_cast<double*>(v->untyped_data()), info_out,
                       MPI_DOUBLE, MPI_DOUBLE);
    case kC:
      return EighTyped(
          c, prec, nb,
          static_cast<const std::complex<float>*>(a.untyped_data()),
          static_cast<float*>(w->untyped_data()),
          static_cast<std::complex<float>*>(v->untyped_data()), info_out,
          MPI_C_FLOAT_COMPLEX, MPI_FLOAT);
    default:
      return EighTyped(
          c, prec, nb,
          static_cast<const std::complex<double>*>(a.untyped_data()),
          static_cast<double*>(w->untyped_data()),
          static_cast<std::complex<double>*>(v->untyped_data()), info_out,
          MPI_C_DOUBLE_COMPLEX, MPI_DOUBLE);
  }
}

}  // namespace scalapack
}  // namespace distlinalg

namespace dl = distlinalg;
namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(DlScalapackSolve, dl::scalapack::SolveImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Attr<int64_t>("comm")
                                  .Attr<ffi::Span<const int64_t>>("sizes")
                                  .Attr<int32_t>("kind")
                                  .Attr<int64_t>("nprow")
                                  .Attr<int64_t>("npcol")
                                  .Attr<int64_t>("nb")
                                  .Ctx<ffi::RunId>()
                                  .Attr<int64_t>("site"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DlScalapackEigh, dl::scalapack::EighImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Attr<int64_t>("comm")
                                  .Attr<ffi::Span<const int64_t>>("sizes")
                                  .Attr<int64_t>("nprow")
                                  .Attr<int64_t>("npcol")
                                  .Attr<int64_t>("nb")
                                  .Ctx<ffi::RunId>()
                                  .Attr<int64_t>("site"));
