// XLA FFI handlers of the non-blocking collectives: a start handler posts
// MPI_Iallreduce / MPI_Iallgather, a wait handler completes it and writes
// the result.
//
// XLA may reuse an operand's buffer as soon as the handler that read it
// returns, and allocates a result only for the handler that writes it, so
// the buffers MPI works on between start and wait belong to the request:
// the start copies the operand in, the wait copies the result out. A
// request is found by the `request` attribute, a number the lowering gives
// one start/wait pair (comm/nonblocking.py): the pair of a program runs
// start then wait, in program order, on every execution.
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "checks.h"
#include "handlers.h"

namespace distlinalg {
namespace {

struct PendingRequest {
  const char* op = "";
  const char* wait_name = "";  // what the watchdog and debug log call the wait
  MPI_Comm comm = MPI_COMM_NULL;
  std::vector<MPI_Request> requests;
  std::unique_ptr<char[]> send;
  std::unique_ptr<char[]> recv;
  size_t recv_bytes = 0;
};

std::mutex& TableMutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<int64_t, std::unique_ptr<PendingRequest>>& Table() {
  static auto* table = new std::unordered_map<int64_t, std::unique_ptr<PendingRequest>>();
  return *table;
}

ffi::Error Posted(int64_t key, std::unique_ptr<PendingRequest> pending) {
  std::lock_guard<std::mutex> lock(TableMutex());
  auto [it, inserted] = Table().emplace(key, nullptr);
  if (!inserted) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string("distlinalg: ") + pending->op +
                          " started again before its previous start was waited for");
  }
  it->second = std::move(pending);
  return ffi::Error::Success();
}

ffi::Error Unsupported(const char* op, ffi::DataType dtype) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("distlinalg: ") + op + " does not support dtype " +
                        DtypeName(dtype));
}

ffi::Error BadOp(const char* name, int32_t op, ffi::DataType dtype) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("distlinalg: ") + name + " with op " +
                        OpName(static_cast<ReduceOp>(op)) + " is not defined for dtype " +
                        DtypeName(dtype));
}

// A request of operation `op` holding a copy of x (its send buffer) and room
// for `recv_bytes` of result. `wait_name` must be a literal, as `op`.
ffi::Error NewPending(const char* op, const char* wait_name, MPI_Comm comm,
                      const ffi::AnyBuffer& x, size_t recv_bytes,
                      std::unique_ptr<PendingRequest>* out) {
  auto pending = std::make_unique<PendingRequest>();
  pending->op = op;
  pending->wait_name = wait_name;
  pending->comm = comm;
  const size_t bytes = x.size_bytes();
  pending->send.reset(new char[bytes > 0 ? bytes : 1]);
  pending->recv.reset(new char[recv_bytes > 0 ? recv_bytes : 1]);
  pending->recv_bytes = recv_bytes;
  DL_CHECK(CopyBytes(pending->send.get(), x.untyped_data(), bytes));
  *out = std::move(pending);
  return ffi::Error::Success();
}

int CommSize(MPI_Comm comm) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  return size;
}

}  // namespace

// x -> a zero-byte marker; the reduction of x over the ranks lands in the
// request, to be copied out by the wait. Counts beyond the per-call cap are
// posted as several reductions, completed together.
ffi::Error IallreduceImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                          ffi::Result<ffi::AnyBuffer>, int64_t comm_handle,
                          int32_t op, int64_t key, ffi::RunId run, int64_t site) {
  MpiLock lock;
  DL_CHECK(CheckNotFinalized("iallreduce"));
  MPI_Comm comm = CommFromHandle(comm_handle);
  TypeInfo ti = MpiType(x.element_type());
  if (!ti.ok) return Unsupported("iallreduce", x.element_type());
  const int64_t n = x.element_count();
  CallRecord record("iallreduce", comm, x.element_type(), n);
  DL_CHECKED_CALL(record, Signature("iallreduce").Buffer(x).Op(op),
                  CheckCollective(dl_sig_, comm));
  MPI_Op mop = MpiOp(static_cast<ReduceOp>(op), x.element_type());
  if (mop == MPI_OP_NULL) return BadOp("iallreduce", op, x.element_type());
  std::unique_ptr<PendingRequest> pending;
  DL_CHECK(NewPending("iallreduce", "wait(iallreduce)", comm, x, x.size_bytes(), &pending));
  const int64_t cap = GlobalSettings().max_count;
  for (int64_t offset = 0; offset < n || (n == 0 && offset == 0); offset += cap) {
    const int count = static_cast<int>(std::min<int64_t>(cap, n - offset));
    const size_t at = static_cast<size_t>(offset) * ti.itemsize;
    pending->requests.push_back(MPI_REQUEST_NULL);
    DL_MPI_CHECK("iallreduce",
                 MPI_Iallreduce(pending->send.get() + at, pending->recv.get() + at, count,
                                ti.type, mop, comm, &pending->requests.back()));
    if (n == 0) break;
  }
  return Posted(key, std::move(pending));
}

// x: s -> a zero-byte marker; every rank's x, stacked (size, *s), lands in
// the request.
ffi::Error IallgatherImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                          ffi::Result<ffi::AnyBuffer>, int64_t comm_handle,
                          int64_t key, ffi::RunId run, int64_t site) {
  MpiLock lock;
  DL_CHECK(CheckNotFinalized("iallgather"));
  MPI_Comm comm = CommFromHandle(comm_handle);
  TypeInfo ti = MpiType(x.element_type());
  if (!ti.ok) return Unsupported("iallgather", x.element_type());
  const int64_t n = x.element_count();
  CallRecord record("iallgather", comm, x.element_type(), n);
  DL_CHECKED_CALL(record, Signature("iallgather").Buffer(x), CheckCollective(dl_sig_, comm));
  std::unique_ptr<PendingRequest> pending;
  DL_CHECK(NewPending("iallgather", "wait(iallgather)", comm, x,
                      x.size_bytes() * static_cast<size_t>(CommSize(comm)), &pending));
  // A block of more elements than an int counts is one element of a
  // contiguous type (freed here: MPI keeps it alive while the call runs).
  BlockType block;
  DL_MPI_CHECK("iallgather", block.Init(n, ti.type));
  pending->requests.push_back(MPI_REQUEST_NULL);
  DL_MPI_CHECK("iallgather",
               MPI_Iallgather(pending->send.get(), block.count(), block.type(),
                              pending->recv.get(), block.count(), block.type(), comm,
                              &pending->requests.back()));
  return Posted(key, std::move(pending));
}

// x: (size, *s) -> a zero-byte marker; block r of every rank's x, summed
// (op), lands in rank r's request: the transpose of iallgather. Blocks
// beyond the per-call cap go as one chunked reduction per destination rank.
ffi::Error IreduceScatterImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                              ffi::Result<ffi::AnyBuffer>, int64_t comm_handle, int32_t op,
                              int64_t key, ffi::RunId run, int64_t site) {
  MpiLock lock;
  DL_CHECK(CheckNotFinalized("ireduce_scatter"));
  MPI_Comm comm = CommFromHandle(comm_handle);
  TypeInfo ti = MpiType(x.element_type());
  if (!ti.ok) return Unsupported("ireduce_scatter", x.element_type());
  const int size = CommSize(comm);
  const int64_t n = x.element_count() / size;
  CallRecord record("ireduce_scatter", comm, x.element_type(), n);
  DL_CHECKED_CALL(record, Signature("ireduce_scatter").Buffer(x).Op(op),
                  CheckCollective(dl_sig_, comm));
  MPI_Op mop = MpiOp(static_cast<ReduceOp>(op), x.element_type());
  if (mop == MPI_OP_NULL) return BadOp("ireduce_scatter", op, x.element_type());
  std::unique_ptr<PendingRequest> pending;
  DL_CHECK(NewPending("ireduce_scatter", "wait(ireduce_scatter)", comm, x,
                      x.size_bytes() / size, &pending));
  const int64_t cap = GlobalSettings().max_count;
  if (n <= cap) {
    pending->requests.push_back(MPI_REQUEST_NULL);
    DL_MPI_CHECK("ireduce_scatter",
                 MPI_Ireduce_scatter_block(pending->send.get(), pending->recv.get(),
                                           static_cast<int>(n), ti.type, mop, comm,
                                           &pending->requests.back()));
    return Posted(key, std::move(pending));
  }
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  for (int r = 0; r < size; ++r) {
    const char* block = pending->send.get() + static_cast<size_t>(r) * pending->recv_bytes;
    for (int64_t offset = 0; offset < n; offset += cap) {
      const int count = static_cast<int>(std::min<int64_t>(cap, n - offset));
      const size_t at = static_cast<size_t>(offset) * ti.itemsize;
      pending->requests.push_back(MPI_REQUEST_NULL);
      DL_MPI_CHECK("ireduce_scatter",
                   MPI_Ireduce(block + at, rank == r ? pending->recv.get() + at : nullptr, count,
                               ti.type, mop, r, comm, &pending->requests.back()));
    }
  }
  return Posted(key, std::move(pending));
}

// The zero-byte marker of a start -> its result, once MPI has completed it.
ffi::Error WaitImpl(ffi::Token, ffi::AnyBuffer, ffi::Result<ffi::Token>,
                    ffi::Result<ffi::AnyBuffer> y, int64_t key, ffi::RunId, int64_t) {
  std::unique_ptr<PendingRequest> pending;
  {
    std::lock_guard<std::mutex> lock(TableMutex());
    auto it = Table().find(key);
    if (it == Table().end()) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "distlinalg: wait on a request that was not started (or was "
                        "waited for already)");
    }
    pending = std::move(it->second);
    Table().erase(it);
  }
  if (pending->recv_bytes != y->size_bytes()) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("distlinalg: wait of ") + pending->op + ": the result holds " +
                          std::to_string(y->size_bytes()) + " bytes, the request " +
                          std::to_string(pending->recv_bytes));
  }
  {
    MpiLock lock;
    CallRecord record(pending->wait_name, pending->comm, y->element_type(), y->element_count());
    DL_MPI_CHECK(pending->op, MPI_Waitall(static_cast<int>(pending->requests.size()),
                                          pending->requests.data(), MPI_STATUSES_IGNORE));
  }
  return CopyBytes(y->untyped_data(), pending->recv.get(), pending->recv_bytes);
}

std::string WaitAndDiscard(int64_t key) {
  std::unique_ptr<PendingRequest> pending;
  {
    std::lock_guard<std::mutex> lock(TableMutex());
    auto it = Table().find(key);
    if (it == Table().end()) return "";
    pending = std::move(it->second);
    Table().erase(it);
  }
  MpiLock lock;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return std::string(pending->op) + ": MPI was finalised before the wait";
  int rc = MPI_Waitall(static_cast<int>(pending->requests.size()), pending->requests.data(),
                       MPI_STATUSES_IGNORE);
  return rc == MPI_SUCCESS ? "" : MpiErrorString(rc);
}

}  // namespace distlinalg

namespace dl = distlinalg;
namespace ffi = xla::ffi;

#define DL_START(b)                                                                      \
  b.Arg<ffi::Token>().Arg<ffi::AnyBuffer>().Ret<ffi::Token>().Ret<ffi::AnyBuffer>().Attr< \
      int64_t>("comm")
#define DL_IALLREDUCE(b) \
  DL_START(b).Attr<int32_t>("op").Attr<int64_t>("request").Ctx<ffi::RunId>().Attr<int64_t>("site")
#define DL_IALLGATHER(b) \
  DL_START(b).Attr<int64_t>("request").Ctx<ffi::RunId>().Attr<int64_t>("site")
#define DL_WAIT(b)                                                                       \
  b.Arg<ffi::Token>().Arg<ffi::AnyBuffer>().Ret<ffi::Token>().Ret<ffi::AnyBuffer>().Attr< \
      int64_t>("request").Ctx<ffi::RunId>().Attr<int64_t>("site")

// Always staged on CUDA: the request's buffers are host memory.
DL_DEFINE_STAGED_HANDLERS(DlIallreduce, dl::IallreduceImpl, DL_IALLREDUCE);
DL_DEFINE_STAGED_HANDLERS(DlIallgather, dl::IallgatherImpl, DL_IALLGATHER);
DL_DEFINE_STAGED_HANDLERS(DlIreduceScatter, dl::IreduceScatterImpl, DL_IALLREDUCE);
DL_DEFINE_STAGED_HANDLERS(DlWait, dl::WaitImpl, DL_WAIT);
