// XLA FFI handlers of point-to-point communication. A receive's result is
// its template overwritten by the message: bytes the message does not reach
// (all of them for a receive from MPI_PROC_NULL) keep the template's values.
#include <algorithm>

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
  const size_t basic = (dtype == ffi::DataType::F16 || dtype == ffi::DataType::BF16)
                           ? 1
                           : ti.itemsize;
  const size_t total = templ.size_bytes();
  const size_t received =
      elements <= 0 ? 0 : std::min(total, static_cast<size_t>(elements) * basic);
  if (received == total) return ffi::Error::Success();
  return CopyBytes(static_cast<char*>(y->untyped_data()) + received,
                   static_cast<const char*>(templ.untyped_data()) + received,
                   total - received);
}

}  // namespace

ffi::Error SendImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                    int64_t comm_handle, int32_t dest, int32_t tag,
                    ffi::RunId run, int64_t site) {
  MpiLock lock;
  DL_CHECK(CheckNotFinalized("send"));
  MPI_Comm comm = CommFromHandle(comm_handle);
  TypeInfo ti = MpiType(x.element_type());
  if (auto e = CheckTypes("send", ti, x.element_type()); e.failure()) return e;
  const int64_t n = x.element_count();
  CallRecord record("send", comm, x.element_type(), n, dest);
  DL_CHECKED_CALL_IF(PairCheckable(site, tag, tag), record, Signature("send").Buffer(x).Root(dest).Flag(tag),
                  CheckPair(dl_sig_, comm, MPI_PROC_NULL, dest, tag, tag,
                            x.element_type(), n, x.element_type(), n));
  BlockType block;
  DL_MPI_CHECK("send", block.Init(n, ti.type));
  DL_MPI_CHECK("send", MPI_Send(x.untyped_data(), block.count(), block.type(),
                                dest, tag, comm));
  return ffi::Error::Success();
}

ffi::Error RecvImpl(ffi::Token, ffi::AnyBuffer templ, ffi::Result<ffi::Token>,
                    ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                    int32_t source, int32_t tag, ffi::RunId run,
                    int64_t site) {
  MpiLock lock;
  DL_CHECK(CheckNotFinalized("recv"));
  MPI_Comm comm = CommFromHandle(comm_handle);
  TypeInfo ti = MpiType(y->element_type());
  if (auto e = CheckTypes("recv", ti, y->element_type()); e.failure())
    return e;
  const int64_t n = y->element_count();
  CallRecord record("recv", comm, y->element_type(), n, source);
  DL_CHECKED_CALL_IF(PairCheckable(site, tag, tag), record, Signature("recv").Buffer(y).Root(source).Flag(tag),
                  CheckPair(dl_sig_, comm, source, MPI_PROC_NULL, tag, tag,
                            y->element_type(), n, y->element_type(), n));
  BlockType block;
  DL_MPI_CHECK("recv", block.Init(n, ti.type));
  MPI_Status status;
  DL_MPI_CHECK("recv", MPI_Recv(y->untyped_data(), block.count(),
                                block.type(), source, tag, comm, &status));
  return KeepTemplateBeyondMessage("recv", status, block, ti, templ, y);
}

ffi::Error SendrecvImpl(ffi::Token, ffi::AnyBuffer sendbuf,
                        ffi::AnyBuffer recvbuf, ffi::Result<ffi::Token>,
                        ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                        int32_t source, int32_t dest, int32_t sendtag,
                        int32_t recvtag, ffi::RunId run, int64_t site) {
  MpiLock lock;
  DL_CHECK(CheckNotFinalized("sendrecv"));
  MPI_Comm comm = CommFromHandle(comm_handle);
  TypeInfo st = MpiType(sendbuf.element_type());
  TypeInfo rt = MpiType(recvbuf.element_type());
  if (auto e = CheckTypes("sendrecv", st, sendbuf.element_type());
      e.failure())
    return e;
  if (auto e = CheckTypes("sendrecv", rt, recvbuf.element_type());
      e.failure())
    return e;
  const int64_t ns = sendbuf.element_count();
  const int64_t nr = recvbuf.element_count();
  CallRecord record("sendrecv", comm, sendbuf.element_type(), ns, source);
  DL_CHECKED_CALL_IF(PairCheckable(site, sendtag, recvtag), record,
                  Signature("sendrecv").Buffer(sendbuf).Root(source).Flag(dest),
                  CheckPair(dl_sig_, comm, source, dest, sendtag, recvtag,
                            sendbuf.element_type(), ns, recvbuf.element_type(),
                            nr));
  BlockType sblock, rblock;
  DL_MPI_CHECK("sendrecv", sblock.Init(ns, st.type));
  DL_MPI_CHECK("sendrecv", rblock.Init(nr, rt.type));
  MPI_Status status;
  DL_MPI_CHECK("sendrecv",
               MPI_Sendrecv(sendbuf.untyped_data(), sblock.count(),
                            sblock.type(), dest, sendtag, y->untyped_data(),
                            rblock.count(), rblock.type(), source, recvtag,
                            comm, &status));
  return KeepTemplateBeyondMessage("sendrecv", status, rblock, rt, recvbuf, y);
}

}  // namespace distlinalg

namespace dl = distlinalg;
namespace ffi = xla::ffi;

#define DL_SEND(b)                                                  \
  b.Arg<ffi::Token>().Arg<ffi::AnyBuffer>().Ret<ffi::Token>()          \
      .Attr<int64_t>("comm").Attr<int32_t>("dest").Attr<int32_t>("tag")  \
      .Ctx<ffi::RunId>().Attr<int64_t>("site")
#define DL_RECV(b)                                                      \
  b.Arg<ffi::Token>().Arg<ffi::AnyBuffer>().Ret<ffi::Token>()              \
      .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int32_t>("source") \
      .Attr<int32_t>("tag").Ctx<ffi::RunId>().Attr<int64_t>("site")
#define DL_SENDRECV(b)                                                     \
  b.Arg<ffi::Token>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()           \
      .Ret<ffi::Token>().Ret<ffi::AnyBuffer>().Attr<int64_t>("comm")        \
      .Attr<int32_t>("source").Attr<int32_t>("dest").Attr<int32_t>("sendtag") \
      .Attr<int32_t>("recvtag").Ctx<ffi::RunId>().Attr<int64_t>("site")

DL_DEFINE_HANDLERS(DlSend, dl::SendImpl, DL_SEND);
DL_DEFINE_HANDLERS(DlRecv, dl::RecvImpl, DL_RECV);
DL_DEFINE_HANDLERS(DlSendrecv, dl::SendrecvImpl, DL_SENDRECV);
