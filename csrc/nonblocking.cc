// XLA FFI handlers of the non-blocking operations: a start handler posts
// MPI_Iallreduce / MPI_Iallgather / MPI_Isend / MPI_Irecv, a wait handler
// completes it and writes the result.
//
// XLA may reuse an operand's buffer as soon as the handler that read it
// returns, and allocates a result only for the handler that writes it, so
// the buffers MPI works on between start and wait belong to the request:
// the start copies the operand in, the wait copies the result out. A
// request is found by the `request` attribute, a number the lowering gives
// one start/wait pair (comm/nonblocking.py): the pair of a program runs
// start then wait, in program order, on every execution.
#include <cstring>
#include <limits>
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
  // Point-to-point receives: the message's expected element counts (a
  // flagged receive accepts `expected` or `expected + 1` elements, the last
  // one the sender's differentiation flag), its MPI type, and its route for
  // the error messages.
  bool is_recv = false;
  bool flagged = false;
  int64_t expected = 0;
  MPI_Datatype type = MPI_DATATYPE_NULL;
  int peer = MPI_PROC_NULL;
  int tag = 0;
};

std::mutex& TableMutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<int64_t, std::unique_ptr<PendingRequest>>& Table() {
  static auto* table =
      new std::unordered_map<int64_t, std::unique_ptr<PendingRequest>>();
  return *table;
}

ffi::Error Posted(int64_t key, std::unique_ptr<PendingRequest> pending) {
  std::lock_guard<std::mutex> lock(TableMutex());
  auto [it, inserted] = Table().emplace(key, nullptr);
  if (!inserted) {
    return ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        std::string("distlinalg: ") + pending->op +
            " started again before its previous start was waited for");
  }
  it->second = std::move(pending);
  return ffi::Error::Success();
}

ffi::Error Unsupported(const char* op, ffi::DataType dtype) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("distlinalg: ") + op +
                        " does not support dtype " + DtypeName(dtype));
}

ffi::Error BadOp(const char* name, int32_t op, ffi::DataType dtype) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("distlinalg: ") + name + " with op " +
                        OpName(static_cast<ReduceOp>(op)) +
                        " is not defined for dtype " + DtypeName(dtype));
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
                          int32_t op, int64_t key, ffi::RunId run,
                          int64_t site) {
  MpiLock lock;
  DL_CHECK(CheckNotFinalized("iallreduce"));
  DL_COMM_OF_KEY(comm, comm_handle);
  TypeInfo ti = MpiType(x.element_type());
  if (!ti.ok) return Unsupported("iallreduce", x.element_type());
  const int64_t n = x.element_count();
  CallRecord record("iallreduce", comm, x.element_type(), n);
  DL_CHECKED_CALL(record, Signature("iallreduce").Buffer(x).Op(op),
                  CheckCollective(dl_sig_, comm));
  MPI_Op mop = MpiOp(static_cast<ReduceOp>(op), x.element_type());
  if (mop == MPI_OP_NULL) return BadOp("iallreduce", op, x.element_type());
  std::unique_ptr<PendingRequest> pending;
  DL_CHECK(NewPending("iallreduce", "wait(iallreduce)", comm, x, x.size_bytes(),
                      &pending));
  const int64_t cap = GlobalSettings().max_count;
  for (int64_t offset = 0; offset < n || (n == 0 && offset == 0);
       offset += cap) {
    const int count = static_cast<int>(std::min<int64_t>(cap, n - offset));
    const size_t at = static_cast<size_t>(offset) * ti.itemsize;
    pending->requests.push_back(MPI_REQUEST_NULL);
    DL_MPI_CHECK(
        "iallreduce",
        MPI_Iallreduce(pending->send.get() + at, pending->recv.get() + at,
                       count, ti.type, mop, comm, &pending->requests.back()));
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
  DL_COMM_OF_KEY(comm, comm_handle);
  TypeInfo ti = MpiType(x.element_type());
  if (!ti.ok) return Unsupported("iallgather", x.element_type());
  const int64_t n = x.element_count();
  CallRecord record("iallgather", comm, x.element_type(), n);
  DL_CHECKED_CALL(record, Signature("iallgather").Buffer(x),
                  CheckCollective(dl_sig_, comm));
  std::unique_ptr<PendingRequest> pending;
  DL_CHECK(NewPending("iallgather", "wait(iallgather)", comm, x,
                      x.size_bytes() * static_cast<size_t>(CommSize(comm)),
                      &pending));
  // A block of more elements than an int counts is one element of a
  // contiguous type (freed here: MPI keeps it alive while the call runs).
  BlockType block;
  DL_MPI_CHECK("iallgather", block.Init(n, ti.type));
  pending->requests.push_back(MPI_REQUEST_NULL);
  DL_MPI_CHECK("iallgather",
               MPI_Iallgather(pending->send.get(), block.count(), block.type(),
                              pending->recv.get(), block.count(), block.type(),
                              comm, &pending->requests.back()));
  return Posted(key, std::move(pending));
}

// x: (size, *s) -> a zero-byte marker; block r of every rank's x, summed
// (op), lands in rank r's request: the transpose of iallgather. Blocks
// beyond the per-call cap go as one chunked reduction per destination rank.
ffi::Error IreduceScatterImpl(ffi::Token, ffi::AnyBuffer x,
                              ffi::Result<ffi::Token>,
                              ffi::Result<ffi::AnyBuffer>, int64_t comm_handle,
                              int32_t op, int64_t key, ffi::RunId run,
                              int64_t site) {
  MpiLock lock;
  DL_CHECK(CheckNotFinalized("ireduce_scatter"));
  DL_COMM_OF_KEY(comm, comm_handle);
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
    DL_MPI_CHECK(
        "ireduce_scatter",
        MPI_Ireduce_scatter_block(pending->send.get(), pending->recv.get(),
                                  static_cast<int>(n), ti.type, mop, comm,
                                  &pending->requests.back()));
    return Posted(key, std::move(pending));
  }
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  for (int r = 0; r < size; ++r) {
    const char* block =
        pending->send.get() + static_cast<size_t>(r) * pending->recv_bytes;
    for (int64_t offset = 0; offset < n; offset += cap) {
      const int count = static_cast<int>(std::min<int64_t>(cap, n - offset));
      const size_t at = static_cast<size_t>(offset) * ti.itemsize;
      pending->requests.push_back(MPI_REQUEST_NULL);
      DL_MPI_CHECK(
          "ireduce_scatter",
          MPI_Ireduce(block + at,
                      rank == r ? pending->recv.get() + at : nullptr, count,
                      ti.type, mop, r, comm, &pending->requests.back()));
    }
  }
  return Posted(key, std::move(pending));
}

// ---------------------------------------------------------------------------
// Point-to-point. A flagged message (comm/nonblocking.py, AD) carries one
// element more than its buffer: the sender's differentiation flag, all bytes
// set. A flagged receive posts room for it, preset to zero bytes, so it can
// tell a differentiating sender (flag set) from a plain one (a message one
// element shorter, the slot left at zero). `active` (an int32 operand) = 0
// posts nothing: the request completes at once (a derivative message that the
// partner, as its flag said, does not exchange).

int32_t ActiveFlag(const ffi::AnyBuffer& active) {
  return *static_cast<const int32_t*>(active.untyped_data());
}

ffi::Error TooLarge(const char* op, int64_t n) {
  return ffi::Error(
      ffi::ErrorCode::kInvalidArgument,
      std::string("distlinalg: ") + op + " of " + std::to_string(n) +
          " elements: non-blocking point-to-point messages are limited to " +
          std::to_string(std::numeric_limits<int>::max() - 1) +
          " elements (use send/recv for larger ones)");
}

// The request of a point-to-point start: validates the buffer (dtype, size)
// and records the route. `op`/`wait_name` must be literals.
ffi::Error NewP2pPending(const char* op, const char* wait_name,
                         const ffi::AnyBuffer& buffer, int64_t comm_handle,
                         int32_t peer, int32_t tag, TypeInfo* ti,
                         std::unique_ptr<PendingRequest>* out) {
  DL_CHECK(CheckNotFinalized(op));
  *ti = MpiType(buffer.element_type());
  if (!ti->ok) return Unsupported(op, buffer.element_type());
  if (buffer.element_count() + 1 >= std::numeric_limits<int>::max()) {
    return TooLarge(op, buffer.element_count());
  }
  auto pending = std::make_unique<PendingRequest>();
  pending->op = op;
  pending->wait_name = wait_name;
  pending->comm = CommFromKey(comm_handle);
  if (pending->comm == MPI_COMM_NULL) return UnknownCommKey(comm_handle);
  pending->type = ti->type;
  pending->peer = peer;
  pending->tag = tag;
  *out = std::move(pending);
  return ffi::Error::Success();
}

// x -> a zero-byte marker; a copy of x (plus the flag when `flagged`) goes
// to `dest`.
ffi::Error IsendImpl(ffi::Token, ffi::AnyBuffer x, ffi::AnyBuffer active,
                     ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer>,
                     int64_t comm_handle, int32_t dest, int32_t tag,
                     int32_t flagged, int64_t key, ffi::RunId, int64_t) {
  MpiLock lock;
  TypeInfo ti;
  std::unique_ptr<PendingRequest> pending;
  DL_CHECK(NewP2pPending("isend", "wait(isend)", x, comm_handle, dest, tag, &ti,
                         &pending));
  const int64_t n = x.element_count();
  CallRecord record("isend", pending->comm, x.element_type(), n, dest);
  DL_CHECK(record.Alone());
  if (ActiveFlag(active) == 0) return Posted(key, std::move(pending));
  const size_t bytes = x.size_bytes() + (flagged ? ti.itemsize : 0);
  pending->send.reset(new char[bytes > 0 ? bytes : 1]);
  DL_CHECK(CopyBytes(pending->send.get(), x.untyped_data(), x.size_bytes()));
  if (flagged)
    std::memset(pending->send.get() + x.size_bytes(), 0xFF, ti.itemsize);
  pending->requests.push_back(MPI_REQUEST_NULL);
  DL_MPI_CHECK(
      "isend",
      MPI_Isend(pending->send.get(), static_cast<int>(n + (flagged ? 1 : 0)),
                ti.type, dest, tag, pending->comm, &pending->requests.back()));
  return Posted(key, std::move(pending));
}

// template -> a zero-byte marker; the message from `source` lands in the
// request's copy of the template (what a shorter message, or none from
// MPI_PROC_NULL, leaves untouched).
ffi::Error IrecvImpl(ffi::Token, ffi::AnyBuffer templ, ffi::AnyBuffer active,
                     ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer>,
                     int64_t comm_handle, int32_t source, int32_t tag,
                     int32_t flagged, int64_t key, ffi::RunId, int64_t) {
  MpiLock lock;
  TypeInfo ti;
  std::unique_ptr<PendingRequest> pending;
  DL_CHECK(NewP2pPending("irecv", "wait(irecv)", templ, comm_handle, source,
                         tag, &ti, &pending));
  const int64_t n = templ.element_count();
  CallRecord record("irecv", pending->comm, templ.element_type(), n, source);
  DL_CHECK(record.Alone());
  pending->is_recv = true;
  pending->flagged = flagged != 0;
  pending->expected = n;
  const size_t room = templ.size_bytes() + (flagged ? ti.itemsize : 0);
  pending->recv.reset(new char[room > 0 ? room : 1]);
  pending->recv_bytes = templ.size_bytes();
  DL_CHECK(
      CopyBytes(pending->recv.get(), templ.untyped_data(), templ.size_bytes()));
  if (flagged)
    std::memset(pending->recv.get() + templ.size_bytes(), 0, ti.itemsize);
  if (ActiveFlag(active) != 0) {
    pending->requests.push_back(MPI_REQUEST_NULL);
    DL_MPI_CHECK("irecv", MPI_Irecv(pending->recv.get(),
                                    static_cast<int>(n + (flagged ? 1 : 0)),
                                    ti.type, source, tag, pending->comm,
                                    &pending->requests.back()));
  }
  return Posted(key, std::move(pending));
}

namespace {

std::unique_ptr<PendingRequest> TakePending(int64_t key) {
  std::lock_guard<std::mutex> lock(TableMutex());
  auto it = Table().find(key);
  if (it == Table().end()) return nullptr;
  std::unique_ptr<PendingRequest> pending = std::move(it->second);
  Table().erase(it);
  return pending;
}

ffi::Error NotStarted() {
  return ffi::Error(
      ffi::ErrorCode::kFailedPrecondition,
      "distlinalg: wait on a request that was not started (or was "
      "waited for already)");
}

// Completes `pending` (cancels it instead when `cancel`) and checks what a
// receive got; `*flag_set` (may be null): a flagged receive's flag.
ffi::Error Complete(PendingRequest& pending, ffi::DataType dtype, int64_t count,
                    bool cancel, bool* flag_set) {
  MpiLock lock;
  CallRecord record(pending.wait_name, pending.comm, dtype, count);
  std::vector<MPI_Status> statuses(pending.requests.size());
  if (cancel) {
    for (MPI_Request& r : pending.requests)
      DL_MPI_CHECK(pending.op, MPI_Cancel(&r));
  }
  int rc = MPI_SUCCESS;
  ffi::Error waited = WaitOrCancel(
      pending.op, pending.comm, static_cast<int>(pending.requests.size()),
      pending.requests.data(), statuses.data(), &rc);
  if (waited.failure()) {
    // Cancelled (checks.h): the operation never completes; its buffers stay
    // allocated for the life of the process rather than under a pending
    // request.
    pending.send.release();
    pending.recv.release();
    return waited;
  }
  DL_MPI_CHECK(pending.op, rc);
  if (cancel) {
    for (MPI_Status& status : statuses) {
      int cancelled = 0;
      MPI_Test_cancelled(&status, &cancelled);
      if (!cancelled) {
        return ffi::Error(
            ffi::ErrorCode::kFailedPrecondition,
            std::string("distlinalg: a derivative message from rank ") +
                std::to_string(pending.peer) + " (tag " +
                std::to_string(pending.tag) +
                ") arrived although its sender's message said it does not "
                "differentiate: "
                "another differentiated isend of the same route and tag was "
                "already under way. "
                "Differentiate both sides of every isend/irecv pair alike.");
      }
    }
  }
  if (pending.is_recv && !cancel && !statuses.empty() &&
      pending.peer != MPI_PROC_NULL) {
    int received = 0;
    MPI_Get_count(&statuses[0], pending.type, &received);
    const bool plain = received == pending.expected;
    const bool flagged = pending.flagged && received == pending.expected + 1;
    if (!plain && !flagged) {
      return ffi::Error(
          ffi::ErrorCode::kInvalidArgument,
          std::string("distlinalg: irecv from rank ") +
              std::to_string(pending.peer) + " (tag " +
              std::to_string(pending.tag) + ") expected " +
              std::to_string(pending.expected) + " elements of " +
              DtypeName(dtype) + " and received " + std::to_string(received) +
              " (the matching isend sends another shape or dtype)");
    }
  }
  if (flag_set != nullptr) {
    *flag_set = false;
    if (pending.flagged) {
      const char* slot = pending.recv.get() + pending.recv_bytes;
      for (size_t i = 0; i < MpiType(dtype).itemsize; ++i)
        *flag_set = *flag_set || slot[i] != 0;
    }
  }
  return ffi::Error::Success();
}

ffi::Error CopyResult(const PendingRequest& pending,
                      ffi::Result<ffi::AnyBuffer>& y) {
  // A send's wait returns nothing (a zero-element result).
  if (y->size_bytes() == 0) return ffi::Error::Success();
  if (pending.recv_bytes != y->size_bytes()) {
    return ffi::Error(
        ffi::ErrorCode::kInternal,
        std::string("distlinalg: wait of ") + pending.op +
            ": the result holds " + std::to_string(y->size_bytes()) +
            " bytes, the request " + std::to_string(pending.recv_bytes));
  }
  return CopyBytes(y->untyped_data(), pending.recv.get(), pending.recv_bytes);
}

}  // namespace

// The zero-byte marker of a start -> its result, once MPI has completed it.
ffi::Error WaitImpl(ffi::Token, ffi::AnyBuffer, ffi::Result<ffi::Token>,
                    ffi::Result<ffi::AnyBuffer> y, int64_t key, ffi::RunId,
                    int64_t) {
  std::unique_ptr<PendingRequest> pending = TakePending(key);
  if (!pending) return NotStarted();
  DL_CHECK(Complete(*pending, y->element_type(), y->element_count(), false,
                    nullptr));
  return CopyResult(*pending, y);
}

// A flagged receive's marker -> (the message, whether its sender set the flag).
ffi::Error WaitFlagImpl(ffi::Token, ffi::AnyBuffer, ffi::Result<ffi::Token>,
                        ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::AnyBuffer> flag, int64_t key,
                        ffi::RunId, int64_t) {
  std::unique_ptr<PendingRequest> pending = TakePending(key);
  if (!pending) return NotStarted();
  bool set = false;
  DL_CHECK(
      Complete(*pending, y->element_type(), y->element_count(), false, &set));
  *static_cast<int32_t*>(flag->untyped_data()) = set ? 1 : 0;
  return CopyResult(*pending, y);
}

// wait where `active` != 0, else cancel: a derivative message's request,
// posted before its partner's flag was known.
ffi::Error WaitIfImpl(ffi::Token, ffi::AnyBuffer, ffi::AnyBuffer active,
                      ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                      int64_t key, ffi::RunId, int64_t) {
  std::unique_ptr<PendingRequest> pending = TakePending(key);
  if (!pending) return NotStarted();
  DL_CHECK(Complete(*pending, y->element_type(), y->element_count(),
                    ActiveFlag(active) == 0, nullptr));
  return CopyResult(*pending, y);
}

// The fence of comm/overlap.py: reads its operands (so XLA schedules it after
// they are computed), hands the token on (so every later distlinalg
// operation runs after it) and returns a float32 zero that XLA cannot see
// through (added to arrays, it makes their later uses wait for the fence).
ffi::Error FenceImpl(ffi::Token, ffi::RemainingArgs, ffi::Result<ffi::Token>,
                     ffi::Result<ffi::AnyBuffer> zero) {
  std::memset(zero->untyped_data(), 0, zero->size_bytes());
  return ffi::Error::Success();
}

std::string WaitAndDiscard(int64_t key) {
  std::unique_ptr<PendingRequest> pending = TakePending(key);
  if (!pending) return "";
  MpiLock lock;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized)
    return std::string(pending->op) + ": MPI was finalised before the wait";
  // A point-to-point message whose partner never came is cancelled, not
  // waited for: the exit must not hang on it.
  if (std::strcmp(pending->op, "isend") == 0 || pending->is_recv) {
    for (MPI_Request& r : pending->requests) MPI_Cancel(&r);
  }
  int rc = MPI_Waitall(static_cast<int>(pending->requests.size()),
                       pending->requests.data(), MPI_STATUSES_IGNORE);
  return rc == MPI_SUCCESS ? "" : MpiErrorString(rc);
}

}  // namespace distlinalg

namespace dl = distlinalg;
namespace ffi = xla::ffi;

#define DL_START(b)          \
  b.Arg<ffi::Token>()        \
      .Arg<ffi::AnyBuffer>() \
      .Ret<ffi::Token>()     \
      .Ret<ffi::AnyBuffer>() \
      .Attr<int64_t>("comm")
#define DL_IALLREDUCE(b)        \
  DL_START(b)                   \
      .Attr<int32_t>("op")      \
      .Attr<int64_t>("request") \
      .Ctx<ffi::RunId>()        \
      .Attr<int64_t>("site")
#define DL_IALLGATHER(b) \
  DL_START(b).Attr<int64_t>("request").Ctx<ffi::RunId>().Attr<int64_t>("site")
#define DL_WAIT(b)              \
  b.Arg<ffi::Token>()           \
      .Arg<ffi::AnyBuffer>()    \
      .Ret<ffi::Token>()        \
      .Ret<ffi::AnyBuffer>()    \
      .Attr<int64_t>("request") \
      .Ctx<ffi::RunId>()        \
      .Attr<int64_t>("site")

#define DL_P2P_START(b)      \
  b.Arg<ffi::Token>()        \
      .Arg<ffi::AnyBuffer>() \
      .Arg<ffi::AnyBuffer>() \
      .Ret<ffi::Token>()     \
      .Ret<ffi::AnyBuffer>() \
      .Attr<int64_t>("comm")
#define DL_ISEND(b)             \
  DL_P2P_START(b)               \
      .Attr<int32_t>("dest")    \
      .Attr<int32_t>("tag")     \
      .Attr<int32_t>("flagged") \
      .Attr<int64_t>("request") \
      .Ctx<ffi::RunId>()        \
      .Attr<int64_t>("site")
#define DL_IRECV(b)             \
  DL_P2P_START(b)               \
      .Attr<int32_t>("source")  \
      .Attr<int32_t>("tag")     \
      .Attr<int32_t>("flagged") \
      .Attr<int64_t>("request") \
      .Ctx<ffi::RunId>()        \
      .Attr<int64_t>("site")
#define DL_WAIT_FLAG(b)         \
  b.Arg<ffi::Token>()           \
      .Arg<ffi::AnyBuffer>()    \
      .Ret<ffi::Token>()        \
      .Ret<ffi::AnyBuffer>()    \
      .Ret<ffi::AnyBuffer>()    \
      .Attr<int64_t>("request") \
      .Ctx<ffi::RunId>()        \
      .Attr<int64_t>("site")
#define DL_WAIT_IF(b)           \
  b.Arg<ffi::Token>()           \
      .Arg<ffi::AnyBuffer>()    \
      .Arg<ffi::AnyBuffer>()    \
      .Ret<ffi::Token>()        \
      .Ret<ffi::AnyBuffer>()    \
      .Attr<int64_t>("request") \
      .Ctx<ffi::RunId>()        \
      .Attr<int64_t>("site")

// Always staged on CUDA: the request's buffers are host memory.
DL_DEFINE_STAGED_HANDLERS(DlIallreduce, dl::IallreduceImpl, DL_IALLREDUCE);
DL_DEFINE_STAGED_HANDLERS(DlIallgather, dl::IallgatherImpl, DL_IALLGATHER);
DL_DEFINE_STAGED_HANDLERS(DlIreduceScatter, dl::IreduceScatterImpl,
                          DL_IALLREDUCE);
DL_DEFINE_STAGED_HANDLERS(DlWait, dl::WaitImpl, DL_WAIT);
DL_DEFINE_STAGED_HANDLERS(DlIsend, dl::IsendImpl, DL_ISEND);
DL_DEFINE_STAGED_HANDLERS(DlIrecv, dl::IrecvImpl, DL_IRECV);
DL_DEFINE_STAGED_HANDLERS(DlWaitFlag, dl::WaitFlagImpl, DL_WAIT_FLAG);
DL_DEFINE_STAGED_HANDLERS(DlWaitIf, dl::WaitIfImpl, DL_WAIT_IF);

#define DL_FENCE(b) \
  b.Arg<ffi::Token>().RemainingArgs().Ret<ffi::Token>().Ret<ffi::AnyBuffer>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(DlFence, dl::FenceImpl,
                              DL_FENCE(ffi::Ffi::Bind()));
#if defined(DL_WITH_CUDA)
namespace distlinalg {
// On the stream, without waiting for it: the fence must not stall the GPU.
ffi::Error FenceOnStream(CUstream stream, ffi::Token, ffi::RemainingArgs,
                         ffi::Result<ffi::Token>,
                         ffi::Result<ffi::AnyBuffer> zero) {
  return cuda::ZeroAsync(stream, zero->untyped_data(), zero->size_bytes());
}
}  // namespace distlinalg
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DlFenceCuda, dl::FenceOnStream,
    DL_FENCE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<CUstream>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DlFenceCudaEmulated, dl::FenceImpl,
                              DL_FENCE(ffi::Ffi::Bind()));
#endif
