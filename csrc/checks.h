// Cross-rank safety of the handlers: the signature check that turns
// mismatched calls into an error on every rank, and the record of the calls
// in progress that the watchdog (distlinalg/_safety.py) and the debug log
// read.
//
// Check modes (DISTLINALG_CHECK, distlinalg.comm.configure(check=...)):
//   off         no check.
//   first-run   (default) eager calls are checked every time; a call site of
//               a compiled program (the `site` attribute: a hash of the code
//               that made the call, the same on every rank, comm/_core.py's
//               call_site) is checked during the first execution (XLA's
//               RunId) that meets it on its communicator, every iteration
//               of a loop in that execution included, and never again. A
//               rank that compiles a program anew for new local shapes while
//               another reuses its program therefore still agrees with it on
//               whether to check. Steady-state jitted code pays a hash-map
//               lookup per call, no message.
//   every-call  every call is checked, and the per-communicator call count
//               is part of the signature (call order).
// A check is one MPI_Allreduce (max) of (h, -h), h the hash of the call's
// signature, on a private duplicate of the call's communicator; only when
// the hashes differ do the ranks allgather their full signatures to build
// the error message, so every rank returns the same error.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "mpi_common.h"

namespace distlinalg {

enum class CheckMode : int { kOff = 0, kFirstRun = 1, kEveryCall = 2 };

// What a call looks like, as fixed-size integers every rank can compare.
class Signature {
 public:
  static constexpr int kWords = 16;
  static constexpr int kMaxDims = 6;

  explicit Signature(const char* op);
  // The shape and dtype of the buffer that defines the message.
  Signature& Buffer(const ffi::AnyBuffer& b);
  Signature& Buffer(ffi::Result<ffi::AnyBuffer>& b) { return Buffer(*b); }
  Signature& Root(int64_t root);
  Signature& Op(int32_t op);
  Signature& Flag(int64_t flag);

  const char* op() const { return op_; }
  const int64_t* words() const { return words_; }
  int64_t* words() { return words_; }
  int64_t Hash() const;

 private:
  const char* op_;
  int64_t words_[kWords];
};

// Whether a call of this site and run on `comm` with signature `sig` is to be
// checked (see the modes). In first-run mode the answer depends only on the
// site, the communicator, the signature and the calls made before on it,
// which are the same on every rank of a valid program; never on which
// programs this rank compiled.
bool ShouldCheck(int64_t site, int64_t run, MPI_Comm comm,
                 const Signature& sig);

// The check of a collective: every rank of `comm` compares `sig`.
ffi::Error CheckCollective(const Signature& sig, MPI_Comm comm);

// The check of a point-to-point call: partners swap what they send and
// expect, so both sides see a mismatch.
ffi::Error CheckPair(const Signature& sig, MPI_Comm comm, int source, int dest,
                     int sendtag, int recvtag, ffi::DataType send_dtype,
                     int64_t send_count, ffi::DataType recv_dtype,
                     int64_t recv_count);

// The program-end check: every rank reaching the end of its program takes
// part, so a rank still calling distlinalg operations learns that another
// rank has finished. Returns "" or the error message.
std::string CheckAtExit(MPI_Comm comm);

// Creates the private check communicator of `comm` now (collective over
// `comm`); otherwise it is made at the first checked call.
int PrepareChecks(MPI_Comm comm);

// ---------------------------------------------------------------------------
// Calls in progress. Every handler holds a CallRecord while it runs: it is
// numbered, listed for the watchdog and for the other ranks' queries, and
// (DISTLINALG_DEBUG) logged at start and end.
enum class Phase : int64_t { kIdle = 0, kChecking = 1, kRunning = 2 };

struct ActiveCall {
  int64_t seq = 0;
  const char* op = "";
  int64_t comm = 0;
  int rank = -1;
  ffi::DataType dtype = ffi::DataType::INVALID;
  int64_t count = 0;
  int64_t root = -1;
  Phase phase = Phase::kRunning;
  bool checked = false;  // this execution passed a signature check
  int64_t words[Signature::kWords] = {};
  std::chrono::steady_clock::time_point start;
  std::thread::id thread;  // the thread that runs the handler
};

class CallRecord {
 public:
  CallRecord(const char* op, MPI_Comm comm, ffi::DataType dtype, int64_t count,
             int64_t root = -1);
  ~CallRecord();
  CallRecord(const CallRecord&) = delete;
  CallRecord& operator=(const CallRecord&) = delete;
  // The call waits in its signature check / runs (after a check or not).
  void Checking(const Signature& sig);
  void Running(const Signature& sig, bool checked);
  // An error if another thread was inside a call on the same communicator
  // when this one started: MPI forbids concurrent collectives on one
  // communicator, and two threads' messages pair up differently on
  // different ranks (wrong results, silently). Within one program the
  // token orders the calls, so they never overlap. Once that happened on a
  // communicator, every later call on it is refused too (MarkMisused).
  ffi::Error Alone() const;

 private:
  void Update();
  ActiveCall call_;
  const char* other_ = nullptr;  // the other thread's call, if any
  bool misused_ = false;         // two threads used this communicator before
  std::string poisoned_;         // ... on another rank, which told this one
};

// The signature check of a handler, if this site and run need one
// (ShouldCheck), between its record's "checking" and "running" phases.
// CHECK is an expression of `dl_sig_` returning ffi::Error.
#define DL_CHECKED_CALL(record, SIGNATURE, CHECK) \
  DL_CHECKED_CALL_IF(true, record, SIGNATURE, CHECK)
#define DL_CHECKED_CALL_IF(eligible, record, SIGNATURE, CHECK)      \
  DL_CHECK((record).Alone());                                       \
  const Signature dl_sig_ = (SIGNATURE);                            \
  {                                                                 \
    const bool dl_checked_ =                                        \
        (eligible) && ShouldCheck(site, run.run_id, comm, dl_sig_); \
    if (dl_checked_) {                                              \
      (record).Checking(dl_sig_);                                   \
      DL_CHECK(CHECK);                                              \
    }                                                               \
    (record).Running(dl_sig_, dl_checked_);                         \
  }

// Tags at or above this carry distlinalg's derivative messages
// (distlinalg/_mpi.py USER_TAG_LIMIT): their partners legitimately differ in
// whether they receive (a rank whose source sends no tangent receives from
// MPI_PROC_NULL), so they are not pair-checked.
constexpr int kUserTagLimit = 0x1000;

// Point-to-point calls are pair-checked in every-call mode only: partners
// may legitimately run a message eagerly on one side and inside a compiled
// program on the other, so they would not agree on whether to check it in
// first-run mode.
inline bool PairCheckable(int64_t, int sendtag, int recvtag) {
  return sendtag < kUserTagLimit && recvtag < kUserTagLimit &&
         GlobalSettings().check_mode == 2;
}

std::vector<ActiveCall> CurrentCalls();

// Two threads were found using communicator `comm` (a handle) at once: every
// later call on it is an error on this rank, so that the threads still
// running cannot go on pairing their messages with other ranks' wrong ones.
void MarkMisused(int64_t comm);
int64_t CallsStarted();

// Waits cancellably (issue 57). A rank that finds two threads on one
// communicator refuses every later call on it; a call of another rank on
// that communicator then waits for a partner that never comes. So the
// finding travels: the rank tells every rank through the responder (below),
// and the handlers' waits poll instead of blocking in MPI. A wait on a
// communicator poisoned so (here or on another rank) that is still
// incomplete kCancelGrace after the poison became known returns an error:
// by then every rank has stopped starting calls on it, so the operation can
// never complete, and MPI will not write to its buffers afterwards.
constexpr auto kCancelGrace = std::chrono::seconds(1);

// Pacing of a polling wait (WaitOrCancel, the matched probe): the first 256
// polls spin, so a partner a few microseconds behind is met at full speed;
// after that every poll yields the core (before: one yield per 256 polls).
// Where ranks outnumber the node's CPUs (Settings::idle_sleep, chosen at
// import: distlinalg/_runtime/cpu.py), a yielding waiter still took about half
// of the core it shared with the rank it waited for, so there a wait that
// outlasts 1,280 polls sleeps 20 us between polls: 3 ranks on 2 cores, one
// computing while two waited, 2.2 s yielding against 1.0-1.2 s sleeping. Every
// poll still tests, and a 64 MB allreduce was not slower with the sleeps.
// Dedicated cores keep yielding: a yield with the core to itself returns at
// once.
class PollPacer {
 public:
  // After an unsuccessful test. True every kCheckEvery polls of the yield
  // phase: the caller's moment for its slower checks (a poisoned communicator).
  bool Pause() {
    if (++polls_ <= kSpinPolls) return false;
    if (GlobalSettings().idle_sleep && polls_ > kSpinPolls + kYieldPolls)
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    else
      std::this_thread::yield();
    return (polls_ & (kCheckEvery - 1)) == 0;
  }

 private:
  static constexpr uint64_t kSpinPolls = 256;
  static constexpr uint64_t kYieldPolls = 1024;
  static constexpr uint64_t kCheckEvery = 64;
  uint64_t polls_ = 0;
};

// Waits for `n` requests started on `comm` (MPI_Test/Testall until done).
// `*rc` is MPI's return code of the test that completed them (MPI_SUCCESS
// or the error of a completed request, as the blocking call would return).
// The error: the wait was cancelled (the requests are left pending).
// `statuses` may be null.
ffi::Error WaitOrCancel(const char* op, MPI_Comm comm, int n,
                        MPI_Request* requests, MPI_Status* statuses, int* rc);
// The same error as a cancelled wait, or success: for loops that poll
// themselves (a matched probe, the signature checks).
ffi::Error CancelIfPoisoned(const char* op, MPI_Comm comm);

// The service that answers other ranks' "what are you doing?" queries
// (a thread with a pending receive on a private duplicate of `world`). A
// rank whose check has waited a while asks every rank; a rank that is
// inside a call that was not checked, or in a check of another kind, proves
// a mismatch that would otherwise hang. Needs MPI_THREAD_MULTIPLE.
int StartResponder(MPI_Comm world);
void StopResponder();

// An error when MPI has been finalized (MPI calls would abort the process).
ffi::Error CheckNotFinalized(const char* op);

}  // namespace distlinalg
