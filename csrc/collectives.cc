// XLA FFI handlers of the MPI collectives. One handler per operation family;
// the reduction op, root and communicator arrive as attributes, the dtype from
// the buffer. Each handler takes and returns the ordering token JAX threads
// through the program, and hands XLA's buffers to MPI directly.
#include "checks.h"
#include "handlers.h"

namespace distlinalg {
namespace {

inline int CommSize(MPI_Comm comm) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  return size;
}
inline int CommRank(MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  return rank;
}

ffi::Error Unsupported(const char* op, ffi::DataType dtype) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("distlinalg: ") + op +
                        " does not support dtype " + DtypeName(dtype));
}

// One collective: `start(&request)` starts its nonblocking form, which is
// then waited for as the blocking call would be, but cancellably (checks.h,
// WaitOrCancel: a rank left waiting by another rank's refusal returns); or,
// with cancellable collectives off (Settings), `blocking()` is MPI's blocking
// call. Both return MPI's code.
template <typename Blocking, typename Start>
ffi::Error Run(const char* op, MPI_Comm comm, Blocking blocking, Start start) {
  int rc = MPI_SUCCESS;
  if (!GlobalSettings().cancellable_collectives) {
    rc = blocking();
  } else {
    MPI_Request request = MPI_REQUEST_NULL;
    rc = start(&request);
    if (rc == MPI_SUCCESS)
      DL_CHECK(WaitOrCancel(op, comm, 1, &request, nullptr, &rc));
  }
  if (rc != MPI_SUCCESS) return MpiError(op, rc);
  return ffi::Error::Success();
}

// `Run` over chunks of at most the per-call cap: `blocking(offset, count)`,
// `start(offset, count, &request)`. The reductions cannot use a derived
// datatype with the predefined MPI ops.
template <typename Blocking, typename Start>
ffi::Error RunChunks(const char* op, MPI_Comm comm, int64_t n,
                     Blocking blocking, Start start) {
  const int64_t cap = GlobalSettings().max_count;
  auto chunk = [&](int64_t offset, int count) {
    return Run(
        op, comm, [&] { return blocking(offset, count); },
        [&](MPI_Request* r) { return start(offset, count, r); });
  };
  if (n == 0) return chunk(0, 0);
  for (int64_t offset = 0; offset < n; offset += cap) {
    DL_CHECK(
        chunk(offset, static_cast<int>(std::min<int64_t>(cap, n - offset))));
  }
  return ffi::Error::Success();
}

char* Bytes(ffi::AnyBuffer b) { return static_cast<char*>(b.untyped_data()); }
char* Bytes(ffi::Result<ffi::AnyBuffer>& b) {
  return static_cast<char*>(b->untyped_data());
}

// Every handler starts here: the MPI lock, the record of the call in
// progress (watchdog, debug log), then the cross-rank signature check
// (checks.h), which is a hash-map lookup in steady state.
#define DL_PREAMBLE(NAME, dtype, count, root, SIGNATURE) \
  MpiLock dl_lock_;                                      \
  DL_CHECK(CheckNotFinalized(NAME));                     \
  DL_COMM_OF_KEY(comm, comm_handle);                     \
  TypeInfo ti = MpiType(dtype);                          \
  if (!ti.ok) return Unsupported(NAME, dtype);           \
  CallRecord dl_record_(NAME, comm, dtype, count, root); \
  DL_CHECKED_CALL(dl_record_, SIGNATURE, CheckCollective(dl_sig_, comm))

MPI_Op CheckedOp(int32_t op, ffi::DataType dtype) {
  return MpiOp(static_cast<ReduceOp>(op), dtype);
}

ffi::Error BadOp(const char* name, int32_t op, ffi::DataType dtype) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("distlinalg: ") + name + " with op " +
                        OpName(static_cast<ReduceOp>(op)) +
                        " is not defined for dtype " + DtypeName(dtype));
}

}  // namespace

// ---------------------------------------------------------------------------
ffi::Error AllreduceImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                         ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                         int32_t op, ffi::RunId run, int64_t site) {
  const int64_t n = x.element_count();
  DL_PREAMBLE("allreduce", x.element_type(), n, -1,
              Signature("allreduce").Buffer(x).Op(op));
  BackByHugePages(x);
  BackByHugePages(*y);
  MPI_Op mop = CheckedOp(op, x.element_type());
  if (mop == MPI_OP_NULL) return BadOp("allreduce", op, x.element_type());
  char* in = Bytes(x);
  char* out = Bytes(y);
  // XLA may hand the input buffer back as the output (operand aliasing,
  // e.g. a loop carry): then reduce in place.
  const bool in_place = in == out;
  DL_CHECK(RunChunks(
      "allreduce", comm, n,
      [&](int64_t off, int count) {
        size_t b = off * ti.itemsize;
        return MPI_Allreduce(in_place ? MPI_IN_PLACE : in + b, out + b, count,
                             ti.type, mop, comm);
      },
      [&](int64_t off, int count, MPI_Request* r) {
        size_t b = off * ti.itemsize;
        return MPI_Iallreduce(in_place ? MPI_IN_PLACE : in + b, out + b, count,
                              ti.type, mop, comm, r);
      }));
  return ffi::Error::Success();
}

// Result on root; zeros elsewhere (MPI leaves non-root buffers undefined).
ffi::Error ReduceImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                      ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                      int32_t op, int32_t root, ffi::RunId run, int64_t site) {
  const int64_t n = x.element_count();
  DL_PREAMBLE("reduce", x.element_type(), n, root,
              Signature("reduce").Buffer(x).Op(op).Root(root));
  BackByHugePages(x);
  BackByHugePages(*y);
  MPI_Op mop = CheckedOp(op, x.element_type());
  if (mop == MPI_OP_NULL) return BadOp("reduce", op, x.element_type());
  const bool is_root = CommRank(comm) == root;
  char* in = Bytes(x);
  char* out = Bytes(y);
  if (!is_root) DL_CHECK(ZeroBytes(out, n * ti.itemsize));
  DL_CHECK(RunChunks(
      "reduce", comm, n,
      [&](int64_t off, int count) {
        size_t b = off * ti.itemsize;
        return MPI_Reduce(in + b, is_root ? out + b : nullptr, count, ti.type,
                          mop, root, comm);
      },
      [&](int64_t off, int count, MPI_Request* r) {
        size_t b = off * ti.itemsize;
        return MPI_Ireduce(in + b, is_root ? out + b : nullptr, count, ti.type,
                           mop, root, comm, r);
      }));
  return ffi::Error::Success();
}

// Output aliases the input buffer (XLA copies only if the input lives on).
ffi::Error BcastImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                     ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                     int32_t root, ffi::RunId run, int64_t site) {
  const int64_t n = x.element_count();
  DL_PREAMBLE("bcast", x.element_type(), n, root,
              Signature("bcast").Buffer(x).Root(root));
  BackByHugePages(x);
  BackByHugePages(*y);
  char* out = Bytes(y);
  if (CommRank(comm) == root && out != Bytes(x)) {
    DL_CHECK(CopyBytes(out, Bytes(x), n * ti.itemsize));
  }
  BlockType block;
  DL_MPI_CHECK("bcast", block.Init(n, ti.type));
  DL_CHECK(Run(
      "bcast", comm,
      [&] { return MPI_Bcast(out, block.count(), block.type(), root, comm); },
      [&](MPI_Request* r) {
        return MPI_Ibcast(out, block.count(), block.type(), root, comm, r);
      }));
  return ffi::Error::Success();
}

// x: s on every rank; y: (size, *s), filled on root, zeros elsewhere.
ffi::Error GatherImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                      ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                      int32_t root, ffi::RunId run, int64_t site) {
  const int64_t n = x.element_count();
  DL_PREAMBLE("gather", x.element_type(), n, root,
              Signature("gather").Buffer(x).Root(root));
  BackByHugePages(x);
  BackByHugePages(*y);
  const bool is_root = CommRank(comm) == root;
  char* out = Bytes(y);
  if (!is_root) DL_CHECK(ZeroBytes(out, y->element_count() * ti.itemsize));
  BlockType block;
  DL_MPI_CHECK("gather", block.Init(n, ti.type));
  DL_CHECK(Run(
      "gather", comm,
      [&] {
        return MPI_Gather(Bytes(x), block.count(), block.type(),
                          is_root ? out : nullptr, block.count(), block.type(),
                          root, comm);
      },
      [&](MPI_Request* r) {
        return MPI_Igather(Bytes(x), block.count(), block.type(),
                           is_root ? out : nullptr, block.count(), block.type(),
                           root, comm, r);
      }));
  return ffi::Error::Success();
}

// x: (size, *s), significant on root only; y: s.
ffi::Error ScatterImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                       ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                       int32_t root, ffi::RunId run, int64_t site) {
  const int64_t n = y->element_count();
  DL_PREAMBLE("scatter", x.element_type(), n, root,
              Signature("scatter").Buffer(y).Root(root));
  BackByHugePages(x);
  BackByHugePages(*y);
  const bool is_root = CommRank(comm) == root;
  BlockType block;
  DL_MPI_CHECK("scatter", block.Init(n, ti.type));
  DL_CHECK(Run(
      "scatter", comm,
      [&] {
        return MPI_Scatter(is_root ? Bytes(x) : nullptr, block.count(),
                           block.type(), Bytes(y), block.count(), block.type(),
                           root, comm);
      },
      [&](MPI_Request* r) {
        return MPI_Iscatter(is_root ? Bytes(x) : nullptr, block.count(),
                            block.type(), Bytes(y), block.count(), block.type(),
                            root, comm, r);
      }));
  return ffi::Error::Success();
}

// x: s; y: (size, *s).
ffi::Error AllgatherImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                         ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                         ffi::RunId run, int64_t site) {
  const int64_t n = x.element_count();
  DL_PREAMBLE("allgather", x.element_type(), n, -1,
              Signature("allgather").Buffer(x));
  BackByHugePages(x);
  BackByHugePages(*y);
  BlockType block;
  DL_MPI_CHECK("allgather", block.Init(n, ti.type));
  DL_CHECK(Run(
      "allgather", comm,
      [&] {
        return MPI_Allgather(Bytes(x), block.count(), block.type(), Bytes(y),
                             block.count(), block.type(), comm);
      },
      [&](MPI_Request* r) {
        return MPI_Iallgather(Bytes(x), block.count(), block.type(), Bytes(y),
                              block.count(), block.type(), comm, r);
      }));
  return ffi::Error::Success();
}

// x: (size, *s); y: s, the op-reduction of every rank's block `rank`.
ffi::Error ReduceScatterImpl(ffi::Token, ffi::AnyBuffer x,
                             ffi::Result<ffi::Token>,
                             ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                             int32_t op, ffi::RunId run, int64_t site) {
  const int64_t n = y->element_count();
  DL_PREAMBLE("reduce_scatter", x.element_type(), n, -1,
              Signature("reduce_scatter").Buffer(x).Op(op));
  BackByHugePages(x);
  BackByHugePages(*y);
  MPI_Op mop = CheckedOp(op, x.element_type());
  if (mop == MPI_OP_NULL) return BadOp("reduce_scatter", op, x.element_type());
  if (n <= GlobalSettings().max_count) {
    DL_CHECK(Run(
        "reduce_scatter", comm,
        [&] {
          return MPI_Reduce_scatter_block(
              Bytes(x), Bytes(y), static_cast<int>(n), ti.type, mop, comm);
        },
        [&](MPI_Request* r) {
          return MPI_Ireduce_scatter_block(
              Bytes(x), Bytes(y), static_cast<int>(n), ti.type, mop, comm, r);
        }));
    return ffi::Error::Success();
  }
  // Blocks beyond the per-call cap: one chunked reduce per destination rank.
  const int size = CommSize(comm);
  const int rank = CommRank(comm);
  for (int r = 0; r < size; ++r) {
    char* block = Bytes(x) + static_cast<size_t>(r) * n * ti.itemsize;
    DL_CHECK(RunChunks(
        "reduce_scatter", comm, n,
        [&](int64_t off, int c) {
          size_t b = off * ti.itemsize;
          return MPI_Reduce(block + b, rank == r ? Bytes(y) + b : nullptr, c,
                            ti.type, mop, r, comm);
        },
        [&](int64_t off, int c, MPI_Request* req) {
          size_t b = off * ti.itemsize;
          return MPI_Ireduce(block + b, rank == r ? Bytes(y) + b : nullptr, c,
                             ti.type, mop, r, comm, req);
        }));
  }
  return ffi::Error::Success();
}

// x, y: (size, *s); block r of x goes to rank r.
ffi::Error AlltoallImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                        ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                        ffi::RunId run, int64_t site) {
  const int size = [&] {
    int s = 1;  // an unknown key: DL_PREAMBLE returns its error
    MPI_Comm comm = CommFromKey(comm_handle);
    if (comm != MPI_COMM_NULL) MPI_Comm_size(comm, &s);
    return s;
  }();
  const int64_t n = x.element_count() / size;
  DL_PREAMBLE("alltoall", x.element_type(), n, -1,
              Signature("alltoall").Buffer(x));
  BackByHugePages(x);
  BackByHugePages(*y);
  BlockType block;
  DL_MPI_CHECK("alltoall", block.Init(n, ti.type));
  DL_CHECK(Run(
      "alltoall", comm,
      [&] {
        return MPI_Alltoall(Bytes(x), block.count(), block.type(), Bytes(y),
                            block.count(), block.type(), comm);
      },
      [&](MPI_Request* r) {
        return MPI_Ialltoall(Bytes(x), block.count(), block.type(), Bytes(y),
                             block.count(), block.type(), comm, r);
      }));
  return ffi::Error::Success();
}

// Inclusive (MPI_Scan) or exclusive (MPI_Exscan) prefix reduction. For the
// exclusive scan rank 0's output is left zero here; Python replaces it by
// the op's identity.
ffi::Error ScanImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                    ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                    int32_t op, bool exclusive, ffi::RunId run, int64_t site) {
  const int64_t n = x.element_count();
  DL_PREAMBLE(exclusive ? "exscan" : "scan", x.element_type(), n, -1,
              Signature(exclusive ? "exscan" : "scan").Buffer(x).Op(op));
  BackByHugePages(x);
  BackByHugePages(*y);
  MPI_Op mop = CheckedOp(op, x.element_type());
  if (mop == MPI_OP_NULL) return BadOp("scan", op, x.element_type());
  char* in = Bytes(x);
  char* out = Bytes(y);
  if (exclusive && CommRank(comm) == 0)
    DL_CHECK(ZeroBytes(out, n * ti.itemsize));
  DL_CHECK(RunChunks(
      exclusive ? "exscan" : "scan", comm, n,
      [&](int64_t off, int count) {
        size_t b = off * ti.itemsize;
        return exclusive
                   ? MPI_Exscan(in + b, out + b, count, ti.type, mop, comm)
                   : MPI_Scan(in + b, out + b, count, ti.type, mop, comm);
      },
      [&](int64_t off, int count, MPI_Request* r) {
        size_t b = off * ti.itemsize;
        return exclusive
                   ? MPI_Iexscan(in + b, out + b, count, ti.type, mop, comm, r)
                   : MPI_Iscan(in + b, out + b, count, ti.type, mop, comm, r);
      }));
  return ffi::Error::Success();
}

ffi::Error BarrierImpl(ffi::Token, ffi::Result<ffi::Token>, int64_t comm_handle,
                       ffi::RunId run, int64_t site) {
  MpiLock lock;
  DL_CHECK(CheckNotFinalized("barrier"));
  DL_COMM_OF_KEY(comm, comm_handle);
  CallRecord record("barrier", comm, ffi::DataType::TOKEN, 0);
  DL_CHECKED_CALL(record, Signature("barrier"), CheckCollective(dl_sig_, comm));
  DL_CHECK(Run(
      "barrier", comm, [&] { return MPI_Barrier(comm); },
      [&](MPI_Request* r) { return MPI_Ibarrier(comm, r); }));
  return ffi::Error::Success();
}

}  // namespace distlinalg

// ---------------------------------------------------------------------------
namespace dl = distlinalg;
namespace ffi = xla::ffi;

// One signature per handler; DL_DEFINE_HANDLERS (cuda_transport.h) defines
// the CPU handler and, in CUDA builds, its CUDA variants from it.
#define DL_TOKEN_IN_OUT(binding) \
  binding.Arg<ffi::Token>()      \
      .Arg<ffi::AnyBuffer>()     \
      .Ret<ffi::Token>()         \
      .Ret<ffi::AnyBuffer>()

// Every binding ends with the call site (checks.h): XLA's run id and the
// `site` attribute numbered by the lowering.
#define DL_SITE(b) b.Ctx<ffi::RunId>().Attr<int64_t>("site")

#define DL_ALLREDUCE(b) \
  DL_SITE(DL_TOKEN_IN_OUT(b).Attr<int64_t>("comm").Attr<int32_t>("op"))
#define DL_REDUCE(b)                 \
  DL_SITE(DL_TOKEN_IN_OUT(b)         \
              .Attr<int64_t>("comm") \
              .Attr<int32_t>("op")   \
              .Attr<int32_t>("root"))
#define DL_ROOTED(b) \
  DL_SITE(DL_TOKEN_IN_OUT(b).Attr<int64_t>("comm").Attr<int32_t>("root"))
#define DL_PLAIN(b) DL_SITE(DL_TOKEN_IN_OUT(b).Attr<int64_t>("comm"))
#define DL_SCAN(b)                                                             \
  DL_SITE(                                                                     \
      DL_TOKEN_IN_OUT(b).Attr<int64_t>("comm").Attr<int32_t>("op").Attr<bool>( \
          "exclusive"))
#define DL_BARRIER(b) \
  DL_SITE(b.Arg<ffi::Token>().Ret<ffi::Token>().Attr<int64_t>("comm"))

DL_DEFINE_HANDLERS(DlAllreduce, dl::AllreduceImpl, DL_ALLREDUCE);
DL_DEFINE_HANDLERS(DlReduce, dl::ReduceImpl, DL_REDUCE);
DL_DEFINE_HANDLERS(DlBcast, dl::BcastImpl, DL_ROOTED);
DL_DEFINE_HANDLERS(DlGather, dl::GatherImpl, DL_ROOTED);
DL_DEFINE_HANDLERS(DlScatter, dl::ScatterImpl, DL_ROOTED);
DL_DEFINE_HANDLERS(DlAllgather, dl::AllgatherImpl, DL_PLAIN);
DL_DEFINE_HANDLERS(DlReduceScatter, dl::ReduceScatterImpl, DL_ALLREDUCE);
DL_DEFINE_HANDLERS(DlAlltoall, dl::AlltoallImpl, DL_PLAIN);
DL_DEFINE_HANDLERS(DlScan, dl::ScanImpl, DL_SCAN);
DL_DEFINE_HANDLERS(DlBarrier, dl::BarrierImpl, DL_BARRIER);
