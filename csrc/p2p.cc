// XLA FFI handlers of point-to-point communication. A receive's result is
// its template overwritten by the message: bytes the message does not reach
// (all of them for a receive from MPI_PROC_NULL) keep the template's values.
#include <algorithm>
#include <deque>
#include <vector>
#include <cstdint>
#include <string>

#include "checks.h"
#include "handlers.h"

namespace distlinalg {
namespace {

ffi::Error CheckTypes(const char* op, TypeInfo a, ffi::DataType da) {
  if (a.ok) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("distlinalg: ") + op +
                        " does not support dtype " + DtypeName(da));
}

// A receive leaves y's bytes beyond the message (all of them for
// MPI_PROC_NULL) untouched, and they must hold the template's values. Copying
// only those bytes, after the receive, spares a full copy of the template per
// call when the message fills y, which is the usual case.
ffi::Error KeepTemplateBeyondMessage(const char* op, const MPI_Status& status,
                                     const BlockType& block, TypeInfo ti,
                                     ffi::AnyBuffer templ,
                                     ffi::Result<ffi::AnyBuffer>& y) {
  if (templ.untyped_data() == y->untyped_data()) return ffi::Error::Success();
  MPI_Count elements = 0;
  DL_MPI_CHECK(op, MPI_Get_elements_x(&status, block.type(), &elements));
  // MPI counts basic elements; float16 and bfloat16 are built from bytes.
  const ffi::DataType dtype = templ.element_type();
  const size_t basic =
      (dtype == ffi::DataType::F16 || dtype == ffi::DataType::BF16)
          ? 1
          : ti.itemsize;
  const size_t total = templ.size_bytes();
  const size_t received =
      elements <= 0 ? 0
                    : std::min(total, static_cast<size_t>(elements) * basic);
  if (received == total) return ffi::Error::Success();
  return CopyBytes(static_cast<char*>(y->untyped_data()) + received,
                   static_cast<const char*>(templ.untyped_data()) + received,
                   total - received);
}

// A receive must be filled by its message: a shorter message would leave
// the template's tail in the result without a word, and a longer one is
// truncated by MPI. Both are reported on the receiving rank: a shorter one
// with the two sizes, a longer one with the template's (MPI's status of a
// truncated receive does not hold the message's length, and probing every
// receive first would cost a round trip into MPI per message). `may_lack`
// (distlinalg/comm/p2p.py, _fills): 0, the message fills the template; k > 0,
// it may also lack k elements (the flags of the primal message of a
// differentiated exchange, which a source that does not differentiate does not
// send); -1, it may be shorter (the caller gets the status, which counts it).
// Messages with distlinalg's own tags (derivatives) and from MPI_PROC_NULL are
// not checked.
ffi::Error CheckMessageFills(const char* op, int rc, const MPI_Status& status,
                             int source, int tag, const BlockType& block,
                             TypeInfo ti, ffi::DataType dtype, int64_t expected,
                             int32_t may_lack) {
  const int from = rc == MPI_SUCCESS ? status.MPI_SOURCE : source;
  const int with_tag = rc == MPI_SUCCESS ? status.MPI_TAG : tag;
  auto where = [&] {
    return std::string("distlinalg: ") + op + ": the message from rank " +
           std::to_string(from) + " (tag " + std::to_string(with_tag) + ")";
  };
  const std::string rule =
      ": a point-to-point message must fill its receive template exactly (same "
      "element count "
      "on both sides, batch dimensions included; recv/sendrecv with "
      "return_status=True accept "
      "a shorter message and report its size)";
  if (rc != MPI_SUCCESS) {
    int error_class = MPI_SUCCESS;
    MPI_Error_class(rc, &error_class);
    if (error_class != MPI_ERR_TRUNCATE) return MpiError(op, rc);
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      where() + " is longer than the receive template of " +
                          std::to_string(expected) + " elements of " +
                          DtypeName(dtype) +
                          " (MPI truncated it; MPI does not report a truncated "
                          "message's length)" +
                          rule);
  }
  if (from == MPI_PROC_NULL || with_tag >= kUserTagLimit)
    return ffi::Error::Success();
  MPI_Count elements = 0;
  DL_MPI_CHECK(op, MPI_Get_elements_x(&status, block.type(), &elements));
  // MPI counts basic elements; float16 and bfloat16 are built from bytes.
  const bool bytes =
      dtype == ffi::DataType::F16 || dtype == ffi::DataType::BF16;
  const int64_t received =
      bytes ? static_cast<int64_t>(elements) / static_cast<int64_t>(ti.itemsize)
            : static_cast<int64_t>(elements);
  if (received == expected ||
      (may_lack > 0 && received == expected - may_lack) ||
      (may_lack < 0 && received <= expected))
    return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    where() + " has " + std::to_string(received) +
                        " elements of " + DtypeName(dtype) +
                        ", the receive template " + std::to_string(expected) +
                        rule);
}

// Early arrivals. A receive with MPI_ANY_TAG (and usually MPI_ANY_SOURCE)
// can meet a derivative message (tag >= kUserTagLimit) that is meant for a
// later, explicit receive of this rank: e.g. in reverse mode a rank that is
// already transposing sends a cotangent to a rank still in its forward
// pass. MPI cannot exclude tags from a wildcard, so such a message is taken
// out of MPI (matched probe), kept here in arrival order, and handed to the
// explicit receive that asks for its (comm, source, tag); that receive
// looks here before asking MPI. Messages of one sender and tag keep their
// order: the kept ones arrived before anything still in flight. Guarded by
// MpiLock like every handler.
struct EarlyArrival {
  MPI_Comm comm;
  int source;
  int tag;
  std::vector<char> bytes;
};

std::deque<EarlyArrival>& EarlyArrivals() {
  static std::deque<EarlyArrival> early;
  return early;
}

// Moves the first kept message of (comm, source, tag) into `y` (of
// `capacity` bytes; bytes beyond the message keep the template's values).
// Returns whether there was one; *received is its size in bytes.
ffi::Error TakeEarly(MPI_Comm comm, int source, int tag, void* y,
                     const void* templ, size_t capacity, bool* found,
                     size_t* received) {
  *found = false;
  auto& early = EarlyArrivals();
  if (early.empty() || tag < kUserTagLimit || source == MPI_PROC_NULL)
    return ffi::Error::Success();
  for (auto it = early.begin(); it != early.end(); ++it) {
    if (it->comm != comm || it->source != source || it->tag != tag) continue;
    if (it->bytes.size() > capacity) {
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "distlinalg: a derivative message of " +
                            std::to_string(it->bytes.size()) +
                            " bytes does not fit the receive buffer of " +
                            std::to_string(capacity) +
                            " bytes (message truncated)");
    }
    *found = true;
    *received = it->bytes.size();
    DL_CHECK(CopyBytes(y, it->bytes.data(), it->bytes.size()));
    if (templ != y) {
      DL_CHECK(CopyBytes(static_cast<char*>(y) + *received,
                         static_cast<const char*>(templ) + *received,
                         capacity - *received));
    }
    early.erase(it);
    return ffi::Error::Success();
  }
  return ffi::Error::Success();
}

// Blocking point-to-point calls, made of nonblocking ones and a cancellable
// wait (checks.h, WaitOrCancel): a rank left waiting by another rank's
// refusal (two threads on one communicator) returns with the error. A
// cancelled receive is cancelled in MPI too, so that no later message
// lands in a buffer XLA has taken back.
ffi::Error SendCancellable(const char* op, const void* data,
                           const BlockType& block, int dest, int tag,
                           MPI_Comm comm) {
  MPI_Request request;
  DL_MPI_CHECK(op, MPI_Isend(data, block.count(), block.type(), dest, tag, comm,
                             &request));
  int rc = MPI_SUCCESS;
  DL_CHECK(WaitOrCancel(op, comm, 1, &request, nullptr, &rc));
  DL_MPI_CHECK(op, rc);
  return ffi::Error::Success();
}

// Waits for a posted receive; `*rc` and `*status` as MPI_Recv's.
ffi::Error AwaitReceive(const char* op, MPI_Comm comm, MPI_Request* request,
                        MPI_Status* status, int* rc) {
  ffi::Error waited = WaitOrCancel(op, comm, 1, request, status, rc);
  if (waited.failure()) {
    MPI_Cancel(request);
    MPI_Wait(request, MPI_STATUS_IGNORE);
  }
  return waited;
}

// MPI_Sendrecv, cancellably: `*rc` and `*status` are the receive's.
ffi::Error SendrecvCancellable(const char* op, const void* send,
                               const BlockType& sblock, int dest, int sendtag,
                               void* recv, const BlockType& rblock, int source,
                               int recvtag, MPI_Comm comm, MPI_Status* status,
                               int* rc) {
  MPI_Request requests[2];
  DL_MPI_CHECK(op, MPI_Irecv(recv, rblock.count(), rblock.type(), source,
                             recvtag, comm, &requests[0]));
  *rc = MPI_Isend(send, sblock.count(), sblock.type(), dest, sendtag, comm,
                  &requests[1]);
  if (*rc != MPI_SUCCESS) {
    MPI_Cancel(&requests[0]);
    MPI_Wait(&requests[0], MPI_STATUS_IGNORE);
    return MpiError(op, *rc);
  }
  DL_CHECK(AwaitReceive(op, comm, &requests[0], status, rc));
  int sent = MPI_SUCCESS;
  DL_CHECK(WaitOrCancel(op, comm, 1, &requests[1], nullptr, &sent));
  DL_MPI_CHECK(op, sent);
  return ffi::Error::Success();
}

// A matched probe for the receive (source may be MPI_ANY_SOURCE) with
// MPI_ANY_TAG that skips, and keeps, derivative messages. Polls (MPI_Improbe),
// so that a poisoned communicator cancels it (checks.h).
ffi::Error ProbeUserMessage(MPI_Comm comm, int source, MPI_Message* message,
                            MPI_Status* status) {
  for (;;) {
    for (PollPacer pacer;;) {
      int found = 0;
      DL_MPI_CHECK("recv", MPI_Improbe(source, MPI_ANY_TAG, comm, &found,
                                       message, status));
      if (found) break;
      if (!pacer.Pause()) continue;
      DL_CHECK(CancelIfPoisoned("recv", comm));
    }
    if (status->MPI_TAG < kUserTagLimit) return ffi::Error::Success();
    MPI_Count bytes = 0;
    DL_MPI_CHECK("recv", MPI_Get_elements_x(status, MPI_BYTE, &bytes));
    EarlyArrival kept{comm, status->MPI_SOURCE, status->MPI_TAG,
                      std::vector<char>(static_cast<size_t>(bytes))};
    BlockType block;
    DL_MPI_CHECK("recv", block.Init(bytes, MPI_BYTE));
    DL_MPI_CHECK("recv", MPI_Mrecv(kept.bytes.data(), block.count(),
                                   block.type(), message, MPI_STATUS_IGNORE));
    EarlyArrivals().push_back(std::move(kept));
  }
}

}  // namespace

ffi::Error SendImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                    int64_t comm_handle, int32_t dest, int32_t tag,
                    ffi::RunId run, int64_t site) {
  MpiLock lock;
  DL_CHECK(CheckNotFinalized("send"));
  DL_COMM_OF_KEY(comm, comm_handle);
  TypeInfo ti = MpiType(x.element_type());
  if (auto e = CheckTypes("send", ti, x.element_type()); e.failure()) return e;
  const int64_t n = x.element_count();
  CallRecord record("send", comm, x.element_type(), n, dest);
  DL_CHECKED_CALL_IF(PairCheckable(site, tag, tag), record,
                     Signature("send").Buffer(x).Root(dest).Flag(tag),
                     CheckPair(dl_sig_, comm, MPI_PROC_NULL, dest, tag, tag,
                               x.element_type(), n, x.element_type(), n));
  BackByHugePages(x);
  BlockType block;
  DL_MPI_CHECK("send", block.Init(n, ti.type));
  return SendCancellable("send", x.untyped_data(), block, dest, tag, comm);
}

ffi::Error RecvImpl(ffi::Token, ffi::AnyBuffer templ, ffi::Result<ffi::Token>,
                    ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                    int32_t source, int32_t tag, ffi::RunId run, int64_t site) {
  MpiLock lock;
  DL_CHECK(CheckNotFinalized("recv"));
  DL_COMM_OF_KEY(comm, comm_handle);
  TypeInfo ti = MpiType(y->element_type());
  if (auto e = CheckTypes("recv", ti, y->element_type()); e.failure()) return e;
  const int64_t n = y->element_count();
  CallRecord record("recv", comm, y->element_type(), n, source);
  DL_CHECKED_CALL_IF(PairCheckable(site, tag, tag), record,
                     Signature("recv").Buffer(y).Root(source).Flag(tag),
                     CheckPair(dl_sig_, comm, source, MPI_PROC_NULL, tag, tag,
                               y->element_type(), n, y->element_type(), n));
  bool early = false;
  size_t got = 0;
  DL_CHECK(TakeEarly(comm, source, tag, y->untyped_data(), templ.untyped_data(),
                     y->size_bytes(), &early, &got));
  if (early) return ffi::Error::Success();
  BackByHugePages(*y);
  BlockType block;
  DL_MPI_CHECK("recv", block.Init(n, ti.type));
  MPI_Status status;
  MPI_Request request;
  DL_MPI_CHECK("recv", MPI_Irecv(y->untyped_data(), block.count(), block.type(),
                                 source, tag, comm, &request));
  int rc = MPI_SUCCESS;
  DL_CHECK(AwaitReceive("recv", comm, &request, &status, &rc));
  DL_CHECK(CheckMessageFills("recv", rc, status, source, tag, block, ti,
                             y->element_type(), n, 0));
  return KeepTemplateBeyondMessage("recv", status, block, ti, templ, y);
}

ffi::Error SendrecvImpl(ffi::Token, ffi::AnyBuffer sendbuf,
                        ffi::AnyBuffer recvbuf, ffi::Result<ffi::Token>,
                        ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                        int32_t source, int32_t dest, int32_t sendtag,
                        int32_t recvtag, int32_t may_lack, ffi::RunId run,
                        int64_t site) {
  MpiLock lock;
  DL_CHECK(CheckNotFinalized("sendrecv"));
  DL_COMM_OF_KEY(comm, comm_handle);
  TypeInfo st = MpiType(sendbuf.element_type());
  TypeInfo rt = MpiType(recvbuf.element_type());
  if (auto e = CheckTypes("sendrecv", st, sendbuf.element_type()); e.failure())
    return e;
  if (auto e = CheckTypes("sendrecv", rt, recvbuf.element_type()); e.failure())
    return e;
  const int64_t ns = sendbuf.element_count();
  const int64_t nr = recvbuf.element_count();
  CallRecord record("sendrecv", comm, sendbuf.element_type(), ns, source);
  DL_CHECKED_CALL_IF(
      PairCheckable(site, sendtag, recvtag), record,
      Signature("sendrecv").Buffer(sendbuf).Root(source).Flag(dest),
      CheckPair(dl_sig_, comm, source, dest, sendtag, recvtag,
                sendbuf.element_type(), ns, recvbuf.element_type(), nr));
  BackByHugePages(sendbuf);
  BackByHugePages(*y);
  BlockType sblock, rblock;
  DL_MPI_CHECK("sendrecv", sblock.Init(ns, st.type));
  DL_MPI_CHECK("sendrecv", rblock.Init(nr, rt.type));
  bool early = false;
  size_t got = 0;
  DL_CHECK(TakeEarly(comm, source, recvtag, y->untyped_data(),
                     recvbuf.untyped_data(), y->size_bytes(), &early, &got));
  if (early)
    return SendCancellable("sendrecv", sendbuf.untyped_data(), sblock, dest,
                           sendtag, comm);
  MPI_Status status;
  int rc = MPI_SUCCESS;
  DL_CHECK(SendrecvCancellable("sendrecv", sendbuf.untyped_data(), sblock, dest,
                               sendtag, y->untyped_data(), rblock, source,
                               recvtag, comm, &status, &rc));
  DL_CHECK(CheckMessageFills("sendrecv", rc, status, source, recvtag, rblock,
                             rt, recvbuf.element_type(), nr, may_lack));
  return KeepTemplateBeyondMessage("sendrecv", status, rblock, rt, recvbuf, y);
}

namespace {

// Tags of CheckPair's signature messages (checks.cc): a wildcard receive
// answers its sender's check itself, because it learns who the sender is
// only from that sender's signature message.
constexpr int kSigTag = 32766, kExpectTag = 32765;

// The receiving half of the every-call pair check for a receive from
// MPI_ANY_SOURCE or with MPI_ANY_TAG, plus the sending half towards `dest`.
// Resolves `*source` to the rank whose signature arrived first; the data are
// then received from that rank, so the check and the message concern the same
// sender. Posted in an order without waiting cycles (a ring of wildcard
// exchanges passes).
ffi::Error CheckWildcardPair(MPI_Comm comm, int* source, int dest, int sendtag,
                             int recvtag, ffi::DataType send_dtype,
                             int64_t send_count, ffi::DataType recv_dtype,
                             int64_t recv_count) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  // Heap memory, as in CheckPair: never a stack buffer under a pending call.
  auto* w = new int64_t[12]{
      static_cast<int64_t>(send_dtype), send_count, sendtag, 0, 0, 0, 0, 0, 0,
      static_cast<int64_t>(send_dtype), send_count, sendtag};
  int64_t* send_sig = w;
  int64_t* from_source = w + 3;
  int64_t* expect = w + 6;
  int64_t* from_dest = w + 9;
  MPI_Request requests[3];
  DL_MPI_CHECK("signature check",
               MPI_Irecv(from_source, 3, MPI_INT64_T, *source, kSigTag, comm,
                         &requests[0]));
  DL_MPI_CHECK("signature check", MPI_Isend(send_sig, 3, MPI_INT64_T, dest,
                                            kSigTag, comm, &requests[1]));
  DL_MPI_CHECK("signature check", MPI_Irecv(from_dest, 3, MPI_INT64_T, dest,
                                            kExpectTag, comm, &requests[2]));
  MPI_Status st;
  DL_MPI_CHECK("signature check", MPI_Wait(&requests[0], &st));
  const bool receives = *source != MPI_PROC_NULL;
  if (receives) *source = st.MPI_SOURCE;
  // With MPI_ANY_TAG this receive expects whatever tag the sender uses.
  expect[0] = static_cast<int64_t>(recv_dtype);
  expect[1] = recv_count;
  expect[2] = recvtag == MPI_ANY_TAG ? from_source[2] : recvtag;
  MPI_Request reply;
  DL_MPI_CHECK("signature check", MPI_Isend(expect, 3, MPI_INT64_T, *source,
                                            kExpectTag, comm, &reply));
  DL_MPI_CHECK("signature check", MPI_Wait(&reply, MPI_STATUS_IGNORE));
  DL_MPI_CHECK("signature check",
               MPI_Waitall(2, requests + 1, MPI_STATUSES_IGNORE));
  Text msg;
  if (receives && (from_source[0] != expect[0] || from_source[1] > expect[1] ||
                   from_source[2] != expect[2])) {
    msg << "\n  rank " << rank << " expects " << expect[1] << " elements of "
        << DtypeName(recv_dtype) << " from any rank, and rank " << *source
        << " sends " << from_source[1] << " elements of "
        << DtypeName(static_cast<ffi::DataType>(from_source[0])) << " with tag "
        << from_source[2];
  }
  if (dest != MPI_PROC_NULL &&
      (from_dest[0] != send_sig[0] || from_dest[1] < send_sig[1] ||
       from_dest[2] != send_sig[2])) {
    msg << "\n  rank " << rank << " sends " << send_sig[1] << " elements of "
        << DtypeName(send_dtype) << " with tag " << sendtag << " to rank "
        << dest << ", which expects " << from_dest[1] << " elements of "
        << DtypeName(static_cast<ffi::DataType>(from_dest[0])) << " with tag "
        << from_dest[2];
  }
  delete[] w;
  if (msg.str().empty()) return ffi::Error::Success();
  return ffi::Error(
      ffi::ErrorCode::kInvalidArgument,
      "distlinalg: point-to-point mismatch (wildcard receive):" + msg.str());
}

ffi::Error CheckRouteValue(MPI_Comm comm, int rank, int tag, bool rank_wildcard,
                           bool tag_wildcard) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  const bool rank_ok = rank == MPI_PROC_NULL ||
                       (rank_wildcard && rank == MPI_ANY_SOURCE) ||
                       (rank >= 0 && rank < size);
  const bool tag_ok = (tag_wildcard && tag == MPI_ANY_TAG) || tag >= 0;
  if (rank_ok && tag_ok) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    "distlinalg: sendrecv_status: a route computed at run time "
                    "names rank " +
                        std::to_string(rank) + " and tag " +
                        std::to_string(tag) +
                        ", not a valid (rank, tag) of a "
                        "communicator of size " +
                        std::to_string(size));
}

}  // namespace

// Sendrecv that reports the MPI status of its receive: (source, tag, number
// of elements received, in the template's dtype; -1 beyond int32) as int32[3].
// Source and recvtag may be MPI_ANY_SOURCE / MPI_ANY_TAG. `dynamic` bit 1
// takes (source, recvtag) from route[0:2] and bit 2 (dest, sendtag) from
// route[2:4]: values known only at run time (the status of an earlier
// wildcard receive), for the derivative messages of that receive.
ffi::Error SendrecvStatusImpl(ffi::Token, ffi::AnyBuffer sendbuf,
                              ffi::AnyBuffer recvbuf, ffi::AnyBuffer route,
                              ffi::Result<ffi::Token>,
                              ffi::Result<ffi::AnyBuffer> y,
                              ffi::Result<ffi::AnyBuffer> status_out,
                              int64_t comm_handle, int32_t source, int32_t dest,
                              int32_t sendtag, int32_t recvtag, int32_t dynamic,
                              int32_t may_lack, ffi::RunId run, int64_t site) {
  MpiLock lock;
  DL_CHECK(CheckNotFinalized("sendrecv"));
  DL_COMM_OF_KEY(comm, comm_handle);
  TypeInfo st = MpiType(sendbuf.element_type());
  TypeInfo rt = MpiType(recvbuf.element_type());
  if (auto e = CheckTypes("sendrecv", st, sendbuf.element_type()); e.failure())
    return e;
  if (auto e = CheckTypes("sendrecv", rt, recvbuf.element_type()); e.failure())
    return e;
  if (dynamic != 0) {
    // The route may live on a device (CUDA-aware transport): copy it.
    int32_t r[4] = {0, 0, 0, 0};
    DL_CHECK(CopyBytes(r, route.untyped_data(), sizeof r));
    if (dynamic & 1) {
      source = r[0];
      recvtag = r[1];
      DL_CHECK(CheckRouteValue(comm, source, recvtag, false, false));
    }
    if (dynamic & 2) {
      dest = r[2];
      sendtag = r[3];
      DL_CHECK(CheckRouteValue(comm, dest, sendtag, false, false));
    }
  }
  const int64_t ns = sendbuf.element_count();
  const int64_t nr = recvbuf.element_count();
  CallRecord record("sendrecv", comm, sendbuf.element_type(), ns,
                    source == MPI_ANY_SOURCE ? -1 : source);
  const bool wildcard = source == MPI_ANY_SOURCE || recvtag == MPI_ANY_TAG;
  const bool checkable =
      PairCheckable(site, sendtag, recvtag == MPI_ANY_TAG ? 0 : recvtag);
  if (wildcard) {
    DL_CHECKED_CALL_IF(
        checkable, record,
        Signature("sendrecv").Buffer(sendbuf).Root(source).Flag(dest),
        CheckWildcardPair(comm, &source, dest, sendtag, recvtag,
                          sendbuf.element_type(), ns, recvbuf.element_type(),
                          nr));
  } else {
    DL_CHECKED_CALL_IF(
        checkable, record,
        Signature("sendrecv").Buffer(sendbuf).Root(source).Flag(dest),
        CheckPair(dl_sig_, comm, source, dest, sendtag, recvtag,
                  sendbuf.element_type(), ns, recvbuf.element_type(), nr));
  }
  BackByHugePages(sendbuf);
  BackByHugePages(*y);
  BlockType sblock, rblock;
  DL_MPI_CHECK("sendrecv", sblock.Init(ns, st.type));
  DL_MPI_CHECK("sendrecv", rblock.Init(nr, rt.type));
  const ffi::DataType dtype = recvbuf.element_type();
  const bool half = dtype == ffi::DataType::F16 || dtype == ffi::DataType::BF16;
  MPI_Count items = 0;  // in the template's elements
  int32_t report[3] = {MPI_PROC_NULL, MPI_ANY_TAG, 0};
  bool early = false;
  size_t got = 0;
  DL_CHECK(TakeEarly(comm, source, recvtag, y->untyped_data(),
                     recvbuf.untyped_data(), y->size_bytes(), &early, &got));
  if (early) {
    DL_CHECK(SendCancellable("sendrecv", sendbuf.untyped_data(), sblock, dest,
                             sendtag, comm));
    report[0] = source;
    report[1] = recvtag;
    items = static_cast<MPI_Count>(got / rt.itemsize);
  } else {
    MPI_Status status;
    int rc = MPI_SUCCESS;
    if (recvtag == MPI_ANY_TAG && source != MPI_PROC_NULL) {
      // The send goes out first (a ring of wildcard exchanges must not wait
      // on each other), then the first user message is matched.
      MPI_Request send;
      DL_MPI_CHECK("sendrecv",
                   MPI_Isend(sendbuf.untyped_data(), sblock.count(),
                             sblock.type(), dest, sendtag, comm, &send));
      MPI_Message message;
      ffi::Error probed = ProbeUserMessage(comm, source, &message, &status);
      if (probed.failure()) {
        MPI_Cancel(&send);
        MPI_Wait(&send, MPI_STATUS_IGNORE);
        return probed;
      }
      rc = MPI_Mrecv(y->untyped_data(), rblock.count(), rblock.type(), &message,
                     &status);
      int sent = MPI_SUCCESS;
      DL_CHECK(WaitOrCancel("sendrecv", comm, 1, &send, nullptr, &sent));
      DL_MPI_CHECK("sendrecv", sent);
    } else {
      DL_CHECK(SendrecvCancellable("sendrecv", sendbuf.untyped_data(), sblock,
                                   dest, sendtag, y->untyped_data(), rblock,
                                   source, recvtag, comm, &status, &rc));
    }
    DL_CHECK(CheckMessageFills("sendrecv", rc, status, source, recvtag, rblock,
                               rt, dtype, nr, may_lack));
    DL_CHECK(
        KeepTemplateBeyondMessage("sendrecv", status, rblock, rt, recvbuf, y));
    MPI_Count elements = 0;
    DL_MPI_CHECK("sendrecv",
                 MPI_Get_elements_x(&status, rblock.type(), &elements));
    // Basic elements of float16/bfloat16 are bytes (their types are built
    // from bytes); of every other dtype, items.
    items = elements == MPI_UNDEFINED ? -1 : (half ? elements / 2 : elements);
    report[0] = status.MPI_SOURCE;
    report[1] = status.MPI_TAG;
  }
  if (items > INT32_MAX) items = -1;
  report[2] = static_cast<int32_t>(items);
  if (source == MPI_PROC_NULL) report[2] = 0;
  return CopyBytes(status_out->untyped_data(), report, sizeof report);
}

}  // namespace distlinalg

namespace dl = distlinalg;
namespace ffi = xla::ffi;

#define DL_SEND(b)           \
  b.Arg<ffi::Token>()        \
      .Arg<ffi::AnyBuffer>() \
      .Ret<ffi::Token>()     \
      .Attr<int64_t>("comm") \
      .Attr<int32_t>("dest") \
      .Attr<int32_t>("tag")  \
      .Ctx<ffi::RunId>()     \
      .Attr<int64_t>("site")
#define DL_RECV(b)             \
  b.Arg<ffi::Token>()          \
      .Arg<ffi::AnyBuffer>()   \
      .Ret<ffi::Token>()       \
      .Ret<ffi::AnyBuffer>()   \
      .Attr<int64_t>("comm")   \
      .Attr<int32_t>("source") \
      .Attr<int32_t>("tag")    \
      .Ctx<ffi::RunId>()       \
      .Attr<int64_t>("site")
#define DL_SENDRECV(b)           \
  b.Arg<ffi::Token>()            \
      .Arg<ffi::AnyBuffer>()     \
      .Arg<ffi::AnyBuffer>()     \
      .Ret<ffi::Token>()         \
      .Ret<ffi::AnyBuffer>()     \
      .Attr<int64_t>("comm")     \
      .Attr<int32_t>("source")   \
      .Attr<int32_t>("dest")     \
      .Attr<int32_t>("sendtag")  \
      .Attr<int32_t>("recvtag")  \
      .Attr<int32_t>("may_lack") \
      .Ctx<ffi::RunId>()         \
      .Attr<int64_t>("site")

DL_DEFINE_HANDLERS(DlSend, dl::SendImpl, DL_SEND);
DL_DEFINE_HANDLERS(DlRecv, dl::RecvImpl, DL_RECV);
DL_DEFINE_HANDLERS(DlSendrecv, dl::SendrecvImpl, DL_SENDRECV);

#define DL_SENDRECV_STATUS(b)    \
  b.Arg<ffi::Token>()            \
      .Arg<ffi::AnyBuffer>()     \
      .Arg<ffi::AnyBuffer>()     \
      .Arg<ffi::AnyBuffer>()     \
      .Ret<ffi::Token>()         \
      .Ret<ffi::AnyBuffer>()     \
      .Ret<ffi::AnyBuffer>()     \
      .Attr<int64_t>("comm")     \
      .Attr<int32_t>("source")   \
      .Attr<int32_t>("dest")     \
      .Attr<int32_t>("sendtag")  \
      .Attr<int32_t>("recvtag")  \
      .Attr<int32_t>("dynamic")  \
      .Attr<int32_t>("may_lack") \
      .Ctx<ffi::RunId>()         \
      .Attr<int64_t>("site")

DL_DEFINE_HANDLERS(DlSendrecvStatus, dl::SendrecvStatusImpl,
                   DL_SENDRECV_STATUS);
