#include "checks.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <unordered_map>

namespace distlinalg {

namespace {

// Operation names and their codes in a signature (index + 1). "exit" is the
// end of a rank's program (CheckAtExit).
constexpr const char* kOpNames[] = {
    "allreduce", "reduce",         "bcast",    "gather",   "scatter",
    "allgather", "reduce_scatter", "alltoall", "scan",     "exscan",
    "barrier",   "send",           "recv",     "sendrecv", "exit"};

int64_t OpCode(const char* op) {
  for (size_t i = 0; i < sizeof(kOpNames) / sizeof(kOpNames[0]); ++i) {
    if (std::strcmp(op, kOpNames[i]) == 0) return static_cast<int64_t>(i) + 1;
  }
  return 0;
}

const char* OpNameOf(int64_t code) {
  constexpr int64_t n = sizeof(kOpNames) / sizeof(kOpNames[0]);
  return (code >= 1 && code <= n) ? kOpNames[code - 1] : "an unknown operation";
}

// Word layout of a Signature.
enum Word : int {
  kOpCode = 0,
  kDtype = 1,
  kNdim = 2,
  kDims = 3,                                // kMaxDims words
  kDimsRest = kDims + Signature::kMaxDims,  // hash of dims beyond kMaxDims
  kRoot = kDimsRest + 1,
  kReduceOp = kRoot + 1,
  kFlag = kReduceOp + 1,
  kSequence = kFlag + 1,  // every-call mode: the call's number on the comm
};
static_assert(kSequence < Signature::kWords, "signature words");
constexpr int64_t kUnset = -1;

int64_t Fnv(const int64_t* words, int n) {
  uint64_t h = 1469598103934665603ULL;
  for (int i = 0; i < n; ++i) {
    uint64_t w = static_cast<uint64_t>(words[i]);
    for (int b = 0; b < 8; ++b) {
      h = (h ^ ((w >> (8 * b)) & 0xff)) * 1099511628211ULL;
    }
  }
  return static_cast<int64_t>(h);
}

std::string Describe(const int64_t* w) {
  const int64_t code = w[kOpCode];
  Text s;
  if (code == OpCode("exit")) {
    return "the end of its program (no further distlinalg calls)";
  }
  s << OpNameOf(code) << "(";
  bool any = false;
  if (w[kDtype] != kUnset) {
    s << DtypeName(static_cast<ffi::DataType>(w[kDtype])) << "[";
    const int64_t nd = w[kNdim];
    for (int64_t d = 0; d < nd && d < Signature::kMaxDims; ++d) {
      s << (d ? "," : "") << w[kDims + d];
    }
    if (nd > Signature::kMaxDims) s << ",...";
    s << "]";
    any = true;
  }
  if (w[kReduceOp] != kUnset) {
    s << (any ? ", " : "")
      << "op=" << OpName(static_cast<ReduceOp>(w[kReduceOp]));
    any = true;
  }
  if (w[kRoot] != kUnset) {
    s << (any ? ", " : "") << "root=" << w[kRoot];
    any = true;
  }
  if (w[kFlag] != kUnset) {
    s << (any ? ", " : "") << "flag=" << w[kFlag];
  }
  s << ")";
  if (w[kSequence] != kUnset) s << " as call #" << w[kSequence];
  return s.str();
}

// ---------------------------------------------------------------------------
// The private check communicator of a communicator, cached on it as an MPI
// attribute: it lives and dies with the user's communicator (a freed handle
// that MPI reuses for a new communicator starts without one). Its id is
// agreed by the ranks when it is made, so a rank's report of "the
// communicator I am blocked on" means the same thing on every rank (handles
// need not be equal across processes).
struct CheckState {
  MPI_Comm check = MPI_COMM_NULL;
  int64_t id = -1;
};
std::atomic<int64_t> next_comm_id{0};

int CheckKeyval() {
  static int keyval = [] {
    int k = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(
        MPI_COMM_NULL_COPY_FN,
        [](MPI_Comm, int, void* value, void*) -> int {
          auto* state = static_cast<CheckState*>(value);
          int finalized = 0;
          MPI_Finalized(&finalized);
          if (!finalized) MPI_Comm_free(&state->check);
          delete state;
          return MPI_SUCCESS;
        },
        &k, nullptr);
    return k;
  }();
  return keyval;
}

// The state of `comm` if it has one (no communication).
const CheckState* FindCheckState(MPI_Comm comm) {
  void* value = nullptr;
  int found = 0;
  if (MPI_Comm_get_attr(comm, CheckKeyval(), &value, &found) != MPI_SUCCESS ||
      !found) {
    return nullptr;
  }
  return static_cast<const CheckState*>(value);
}

// The state of `comm`, made now if needed (collective over `comm`).
int CheckComm(MPI_Comm comm, CheckState* out) {
  if (const CheckState* found = FindCheckState(comm)) {
    *out = *found;
    return MPI_SUCCESS;
  }
  auto* state = new CheckState;
  int rc = MPI_Comm_dup(comm, &state->check);
  if (rc != MPI_SUCCESS) {
    delete state;
    return rc;
  }
  MPI_Comm_set_errhandler(state->check, MPI_ERRORS_RETURN);
  MPI_Comm_set_name(state->check, "distlinalg checks");
  int64_t id = next_comm_id.load();
  rc = MPI_Allreduce(MPI_IN_PLACE, &id, 1, MPI_INT64_T, MPI_MAX, state->check);
  if (rc != MPI_SUCCESS) return rc;
  state->id = id;
  int64_t expected = next_comm_id.load();
  while (expected <= id &&
         !next_comm_id.compare_exchange_weak(expected, id + 1)) {
  }
  rc = MPI_Comm_set_attr(comm, CheckKeyval(), state);
  if (rc != MPI_SUCCESS) return rc;
  *out = *state;
  return MPI_SUCCESS;
}

// Checked calls per check communicator (every-call mode's call order).
std::mutex& SequenceMutex() {
  static std::mutex m;
  return m;
}
int64_t NextSequence(int64_t comm_id) {
  static std::map<int64_t, int64_t> counts;
  std::lock_guard<std::mutex> lock(SequenceMutex());
  return counts[comm_id]++;
}

// First-run mode: the run in which each call was first seen, by call site,
// communicator (its check communicator's id, which every rank agrees on) and
// signature (what the check compares, which every rank of a valid program
// shares).
bool FirstRunOfSite(int64_t comm_id, int64_t site, int64_t signature,
                    int64_t run) {
  static std::mutex m;
  static std::map<std::tuple<int64_t, int64_t, int64_t>, int64_t> first_run;
  std::lock_guard<std::mutex> lock(m);
  auto [it, inserted] =
      first_run.emplace(std::make_tuple(comm_id, site, signature), run);
  return inserted || it->second == run;
}

std::string MismatchMessage(const char* op, const std::vector<int64_t>& all,
                            int size) {
  // The signature most ranks share is the reference (rank 0's on a tie).
  std::vector<int64_t> hashes(size);
  for (int r = 0; r < size; ++r) {
    hashes[r] = Fnv(&all[static_cast<size_t>(r) * Signature::kWords],
                    Signature::kWords);
  }
  int reference = 0, best = 0;
  for (int r = 0; r < size; ++r) {
    int votes = 0;
    for (int s = 0; s < size; ++s) votes += hashes[s] == hashes[r];
    if (votes > best) best = votes, reference = r;
  }
  Text differing;
  int ndiff = 0;
  for (int r = 0; r < size; ++r) {
    if (hashes[r] != hashes[reference]) {
      differing << (ndiff++ ? ", " : "") << r;
    }
  }
  Text msg;
  msg << "distlinalg: mismatched communication across ranks, detected before "
      << op << " ran (rank" << (ndiff > 1 ? "s " : " ") << differing.str()
      << " differ" << (ndiff > 1 ? "" : "s") << " from the others):";
  for (int r = 0; r < size; ++r) {
    msg << "\n  rank " << r << ": "
        << Describe(&all[static_cast<size_t>(r) * Signature::kWords])
        << (hashes[r] != hashes[reference] ? "   <-- differs" : "");
  }
  msg << "\nEvery rank must make the same sequence of distlinalg calls, with "
         "the same shapes, dtypes, reduction ops and roots (no collective "
         "inside rank-dependent control flow).";
  return msg.str();
}

// ---------------------------------------------------------------------------
// Waiting for a check with an eye on the other ranks. A check that has not
// completed after kFirstProbe asks every rank what it is doing (the
// responder); if one of them is blocked where it can never meet this check,
// the wait ends with a message instead of a hang. Only the messages of the
// abandoned check are leaked (the job is about to end with the error).
constexpr auto kFirstProbe = std::chrono::seconds(2);
constexpr auto kProbeEvery = std::chrono::seconds(2);
constexpr auto kReplyWait = std::chrono::seconds(1);
constexpr auto kLongWait = std::chrono::milliseconds(20);

std::string ProbeOtherRanks(const Signature& mine, int64_t comm_id, int peer);
bool PoisonedPastGrace(int64_t comm_id,
                       std::chrono::steady_clock::time_point now);

int WaitChecking(int n, MPI_Request* requests, const Signature& mine,
                 int64_t comm_id, int peer, std::string* mismatch) {
  const auto start = std::chrono::steady_clock::now();
  auto next_probe = start + kFirstProbe;
  // Paced as the handlers' own waits (PollPacer): a check is in the path of
  // every call of a program's first run, loop iterations included, so its
  // latency is theirs. Sleeping 200 us after 2,000 polls, as before, made a
  // checked call take 1.1 ms at 3 ranks on 2 cores (0.05 ms unchecked): a
  // partner that was descheduled was met a sleep late. A wait that outlasts
  // kLongWait sleeps between polls, so a rank waiting for a slow partner
  // leaves its core.
  PollPacer pacer;
  for (;;) {
    int done = 0;
    int rc = MPI_Testall(n, requests, &done, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS || done) return rc;
    if (!pacer.Pause()) continue;  // the usual case: done within microseconds
    const auto now = std::chrono::steady_clock::now();
    if (now - start > kLongWait) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (PoisonedPastGrace(comm_id, now)) {
      *mismatch = "distlinalg: the cross-rank check before " +
                  std::string(mine.op()) +
                  " was cancelled: two threads used this communicator at once "
                  "(on this rank or "
                  "another), which refuses every later call on it. Give each "
                  "thread its own "
                  "communicator (comm.Dup()).";
      return MPI_SUCCESS;
    }
    if (now < next_probe) continue;
    *mismatch = ProbeOtherRanks(mine, comm_id, peer);
    if (!mismatch->empty()) return MPI_SUCCESS;
    next_probe = now + kProbeEvery;
  }
}

// The exchange itself: one allreduce of (h, -h); the full signatures only
// when they differ. Leaves `mismatch` empty when every rank agrees.
int Compare(Signature sig, MPI_Comm comm, bool with_sequence,
            std::string* mismatch) {
  CheckState state;
  int rc = CheckComm(comm, &state);
  if (rc != MPI_SUCCESS) return rc;
  if (with_sequence) sig.words()[kSequence] = NextSequence(state.id);
  const int64_t h = sig.Hash();
  // Heap buffers: an abandoned wait must not leave MPI writing to the stack.
  auto* extremes = new int64_t[2]{h, -h};
  MPI_Request request;
  rc = MPI_Iallreduce(MPI_IN_PLACE, extremes, 2, MPI_INT64_T, MPI_MAX,
                      state.check, &request);
  if (rc != MPI_SUCCESS) return rc;
  rc = WaitChecking(1, &request, sig, state.id, -1, mismatch);
  if (rc != MPI_SUCCESS || !mismatch->empty()) return rc;
  const bool same = extremes[0] == h && extremes[1] == -h;
  delete[] extremes;
  if (same) return MPI_SUCCESS;
  int size = 0;
  MPI_Comm_size(state.check, &size);
  std::vector<int64_t> all(static_cast<size_t>(size) * Signature::kWords);
  rc = MPI_Allgather(sig.words(), Signature::kWords, MPI_INT64_T, all.data(),
                     Signature::kWords, MPI_INT64_T, state.check);
  if (rc != MPI_SUCCESS) return rc;
  *mismatch = MismatchMessage(sig.op(), all, size);
  return MPI_SUCCESS;
}

}  // namespace

// ---------------------------------------------------------------------------
Signature::Signature(const char* op) : op_(op) {
  for (auto& w : words_) w = kUnset;
  words_[kOpCode] = OpCode(op);
}

Signature& Signature::Buffer(const ffi::AnyBuffer& b) {
  auto dims = b.dimensions();
  words_[kDtype] = static_cast<int64_t>(b.element_type());
  words_[kNdim] = static_cast<int64_t>(dims.size());
  std::vector<int64_t> rest;
  for (size_t d = 0; d < dims.size(); ++d) {
    if (d < static_cast<size_t>(kMaxDims)) {
      words_[kDims + d] = dims[d];
    } else {
      rest.push_back(dims[d]);
    }
  }
  if (!rest.empty()) {
    words_[kDimsRest] = Fnv(rest.data(), static_cast<int>(rest.size()));
  }
  return *this;
}

Signature& Signature::Root(int64_t root) {
  words_[kRoot] = root;
  return *this;
}
Signature& Signature::Op(int32_t op) {
  words_[kReduceOp] = op;
  return *this;
}
Signature& Signature::Flag(int64_t flag) {
  words_[kFlag] = flag;
  return *this;
}

int64_t Signature::Hash() const { return Fnv(words_, kWords); }

bool ShouldCheck(int64_t site, int64_t run, MPI_Comm comm,
                 const Signature& sig) {
  switch (static_cast<CheckMode>(GlobalSettings().check_mode)) {
    case CheckMode::kOff:
      return false;
    case CheckMode::kEveryCall:
      return true;
    case CheckMode::kFirstRun: {
      if (site == 0) return true;
      // No check communicator yet on any rank (it is made collectively by the
      // first check): nothing on it was checked before.
      const CheckState* state = FindCheckState(comm);
      return state == nullptr ||
             FirstRunOfSite(state->id, site, sig.Hash(), run);
    }
  }
  return true;
}

ffi::Error CheckCollective(const Signature& sig, MPI_Comm comm) {
  const bool every =
      GlobalSettings().check_mode == static_cast<int>(CheckMode::kEveryCall);
  std::string mismatch;
  DL_MPI_CHECK("the signature check", Compare(sig, comm, every, &mismatch));
  if (mismatch.empty()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, mismatch);
}

std::string CheckAtExit(MPI_Comm comm) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized ||
      GlobalSettings().check_mode == static_cast<int>(CheckMode::kOff)) {
    return "";
  }
  MpiLock lock;
  Signature sig("exit");
  CallRecord record("exit", comm, ffi::DataType::TOKEN, 0);
  record.Checking(sig);
  std::string mismatch;
  const bool every =
      GlobalSettings().check_mode == static_cast<int>(CheckMode::kEveryCall);
  int rc = Compare(sig, comm, every, &mismatch);
  if (rc != MPI_SUCCESS)
    return "distlinalg: the end-of-program check failed: " + MpiErrorString(rc);
  return mismatch;
}

int PrepareChecks(MPI_Comm comm) {
  MpiLock lock;
  CheckState state;
  return CheckComm(comm, &state);
}

// ---------------------------------------------------------------------------
namespace {
std::mutex& ActiveMutex() {
  static std::mutex m;
  return m;
}
std::map<int64_t, ActiveCall>& Active() {
  static std::map<int64_t, ActiveCall> active;
  return active;
}
std::atomic<int64_t> calls_started{0};
// Communicators that two threads used at once (guarded by ActiveMutex).
std::unordered_map<int64_t, bool>& Misused() {
  static std::unordered_map<int64_t, bool> misused;
  return misused;
}

// Poisoned communicators (checks.h, WaitOrCancel): by check id, agreed
// across ranks (CheckComm), so that another rank's notice names the same
// communicator; by handle for one that has no check state yet (this rank
// only). `from` is the world rank that found the two threads.
struct Poison {
  int from = -1;
  std::chrono::steady_clock::time_point known;
};
std::mutex& PoisonMutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<int64_t, Poison>& PoisonedIds() {
  static std::unordered_map<int64_t, Poison> ids;
  return ids;
}
std::unordered_map<int64_t, Poison>& PoisonedHandles() {
  static std::unordered_map<int64_t, Poison> handles;
  return handles;
}
std::atomic<int> poisoned_count{0};  // the waits' fast test: nothing poisoned

int WorldRank() {
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

// Returns whether the id was new.
bool PoisonId(int64_t id, int from) {
  std::lock_guard<std::mutex> lock(PoisonMutex());
  if (PoisonedIds().count(id) != 0) return false;
  PoisonedIds()[id] = Poison{from, std::chrono::steady_clock::now()};
  ++poisoned_count;
  return true;
}

void NotifyPeers(int64_t id);  // through the responder (below)

// The records kept by handle (Misused, PoisonedHandles) end with the
// communicator: an attribute whose delete callback (MPI_Comm_free) forgets
// them, so that a new communicator to which MPI gives the freed handle starts
// clean instead of refusing every call (MPICH hands a freed handle to the
// next Dup).
void ForgetHandle(int64_t handle) {
  {
    std::lock_guard<std::mutex> lock(ActiveMutex());
    Misused().erase(handle);
  }
  std::lock_guard<std::mutex> lock(PoisonMutex());
  if (PoisonedHandles().erase(handle) != 0) --poisoned_count;
}

int ForgetKeyval() {
  static int keyval = [] {
    int k = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(
        MPI_COMM_NULL_COPY_FN,
        [](MPI_Comm comm, int, void*, void*) -> int {
          ForgetHandle(HandleFromComm(comm));
          return MPI_SUCCESS;
        },
        &k, nullptr);
    return k;
  }();
  return keyval;
}

// Call before recording `comm` by handle, holding neither record's lock (a
// second set_attr would run the delete callback).
void ForgetWhenFreed(MPI_Comm comm) {
  void* value = nullptr;
  int found = 0;
  if (MPI_Comm_get_attr(comm, ForgetKeyval(), &value, &found) == MPI_SUCCESS &&
      !found)
    MPI_Comm_set_attr(comm, ForgetKeyval(), nullptr);
}

// This rank found two threads on `comm`: poison it here and tell every rank.
void PoisonHere(MPI_Comm comm) {
  ForgetWhenFreed(comm);
  const CheckState* state = FindCheckState(comm);
  if (state == nullptr) {
    std::lock_guard<std::mutex> lock(PoisonMutex());
    auto& handles = PoisonedHandles();
    if (handles.count(HandleFromComm(comm)) == 0) {
      handles[HandleFromComm(comm)] =
          Poison{WorldRank(), std::chrono::steady_clock::now()};
      ++poisoned_count;
    }
    return;
  }
  if (PoisonId(state->id, WorldRank())) NotifyPeers(state->id);
}

bool PoisonOf(MPI_Comm comm, Poison* out) {
  if (poisoned_count.load(std::memory_order_relaxed) == 0) return false;
  const CheckState* state = FindCheckState(comm);
  std::lock_guard<std::mutex> lock(PoisonMutex());
  if (state != nullptr) {
    auto it = PoisonedIds().find(state->id);
    if (it != PoisonedIds().end()) {
      *out = it->second;
      return true;
    }
  }
  auto it = PoisonedHandles().find(HandleFromComm(comm));
  if (it == PoisonedHandles().end()) return false;
  *out = it->second;
  return true;
}

bool PoisonedPastGrace(int64_t comm_id,
                       std::chrono::steady_clock::time_point now) {
  if (poisoned_count.load(std::memory_order_relaxed) == 0 || comm_id < 0)
    return false;
  std::lock_guard<std::mutex> lock(PoisonMutex());
  auto it = PoisonedIds().find(comm_id);
  return it != PoisonedIds().end() && now - it->second.known >= kCancelGrace;
}

std::string PoisonedMessage(const char* op, MPI_Comm comm, const Poison& p) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  Text msg;
  msg << "distlinalg: " << op << " on rank " << rank
      << ": two threads used this communicator at once";
  if (p.from == WorldRank()) {
    msg << " on this rank";
  } else {
    msg << " on rank " << p.from << " of MPI_COMM_WORLD";
  }
  msg << ", which refuses every later call on it, so this call cannot complete "
         "(cancelled). "
         "Give each thread its own communicator (comm.Dup()).";
  return msg.str();
}
}  // namespace

void MarkMisused(int64_t comm) {
  ForgetWhenFreed(CommFromHandle(comm));
  {
    std::lock_guard<std::mutex> lock(ActiveMutex());
    Misused()[comm] = true;
  }
  PoisonHere(CommFromHandle(comm));
}

ffi::Error CancelIfPoisoned(const char* op, MPI_Comm comm) {
  Poison p;
  if (!PoisonOf(comm, &p)) return ffi::Error::Success();
  if (std::chrono::steady_clock::now() - p.known < kCancelGrace)
    return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    PoisonedMessage(op, comm, p));
}

ffi::Error WaitOrCancel(const char* op, MPI_Comm comm, int n,
                        MPI_Request* requests, MPI_Status* statuses, int* rc) {
  for (PollPacer pacer;;) {
    int done = 0;
    *rc = n == 1 ? MPI_Test(requests, &done,
                            statuses ? statuses : MPI_STATUS_IGNORE)
                 : MPI_Testall(n, requests, &done,
                               statuses ? statuses : MPI_STATUSES_IGNORE);
    if (*rc != MPI_SUCCESS || done) return ffi::Error::Success();
    // Polled as MPI's own blocking progress does, but yielding the core once
    // the partner is late (PollPacer); the poison test is one relaxed load
    // while none is known.
    if (!pacer.Pause()) continue;
    if (poisoned_count.load(std::memory_order_relaxed) == 0) continue;
    if (auto e = CancelIfPoisoned(op, comm); e.failure()) return e;
  }
}

CallRecord::CallRecord(const char* op, MPI_Comm comm, ffi::DataType dtype,
                       int64_t count, int64_t root) {
  call_.seq = ++calls_started;
  call_.op = op;
  call_.comm = HandleFromComm(comm);
  MPI_Comm_rank(comm, &call_.rank);
  call_.dtype = dtype;
  call_.count = count;
  call_.root = root;
  call_.start = std::chrono::steady_clock::now();
  call_.thread = std::this_thread::get_id();
  {
    std::lock_guard<std::mutex> lock(ActiveMutex());
    for (const auto& [seq, other] : Active()) {
      if (other.comm == call_.comm && other.thread != call_.thread)
        other_ = other.op;
    }
    if (other_ != nullptr) {
      Misused()[call_.comm] = true;
    } else if (!Misused().empty() && Misused().count(call_.comm) != 0) {
      misused_ = true;
    }
    Active().emplace(call_.seq, call_);
  }
  if (other_ != nullptr) {
    PoisonHere(comm);
  } else if (!misused_) {
    Poison p;
    if (PoisonOf(comm, &p))
      poisoned_ = PoisonedMessage(op, comm, p);  // told by another rank
  }
  if (GlobalSettings().debug_log) {
    std::fprintf(stderr,
                 "distlinalg r%d | %-14s | dtype=%-9s | count=%-10lld | "
                 "start #%lld\n",
                 call_.rank, op, DtypeName(dtype),
                 static_cast<long long>(count),
                 static_cast<long long>(call_.seq));
  }
}

void CallRecord::Checking(const Signature& sig) {
  call_.phase = Phase::kChecking;
  std::memcpy(call_.words, sig.words(), sizeof call_.words);
  Update();
}

void CallRecord::Running(const Signature& sig, bool checked) {
  call_.phase = Phase::kRunning;
  call_.checked = checked;
  std::memcpy(call_.words, sig.words(), sizeof call_.words);
  Update();
}

ffi::Error CallRecord::Alone() const {
  if (!poisoned_.empty())
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, poisoned_);
  if (misused_) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string("distlinalg: ") + call_.op + " on rank " +
                          std::to_string(call_.rank) +
                          ": two threads used this communicator at once (an "
                          "earlier call raised), so its "
                          "messages can no longer be trusted to pair up with "
                          "the other ranks'. Give each thread "
                          "its own communicator (comm.Dup()).");
  }
  if (other_ == nullptr) return ffi::Error::Success();
  return ffi::Error(
      ffi::ErrorCode::kFailedPrecondition,
      std::string("distlinalg: ") + call_.op + " on rank " +
          std::to_string(call_.rank) + ": another thread is inside a call (" +
          other_ +
          ") on the same communicator. MPI forbids concurrent operations on "
          "one communicator, "
          "and the two threads' messages would pair up differently on "
          "different ranks (wrong "
          "results). Give each thread its own communicator (comm.Dup()).");
}

void CallRecord::Update() {
  std::lock_guard<std::mutex> lock(ActiveMutex());
  Active()[call_.seq] = call_;
}

CallRecord::~CallRecord() {
  {
    std::lock_guard<std::mutex> lock(ActiveMutex());
    Active().erase(call_.seq);
  }
  if (!GlobalSettings().debug_log) return;
  double us = std::chrono::duration<double, std::micro>(
                  std::chrono::steady_clock::now() - call_.start)
                  .count();
  std::fprintf(stderr,
               "distlinalg r%d | %-14s | dtype=%-9s | count=%-10lld | "
               "%.1f us\n",
               call_.rank, call_.op, DtypeName(call_.dtype),
               static_cast<long long>(call_.count), us);
}

std::vector<ActiveCall> CurrentCalls() {
  std::lock_guard<std::mutex> lock(ActiveMutex());
  std::vector<ActiveCall> calls;
  for (const auto& [seq, call] : Active()) calls.push_back(call);
  return calls;
}

int64_t CallsStarted() { return calls_started.load(); }

ffi::Error CheckNotFinalized(const char* op) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) return ffi::Error::Success();
  return ffi::Error(
      ffi::ErrorCode::kFailedPrecondition,
      std::string("distlinalg: ") + op +
          " after MPI was finalized (MPI.Finalize() was called, or the "
          "interpreter is exiting); no MPI operation can run after that");
}

// ---------------------------------------------------------------------------
namespace {
std::string DescribePair(int64_t dtype, int64_t count) {
  return std::string(DtypeName(static_cast<ffi::DataType>(dtype))) + "[" +
         std::to_string(count) + " elements]";
}
}  // namespace

ffi::Error CheckPair(const Signature& sig, MPI_Comm comm, int source, int dest,
                     int sendtag, int recvtag, ffi::DataType send_dtype,
                     int64_t send_count, ffi::DataType recv_dtype,
                     int64_t recv_count) {
  // Reserved tags of the check: they never carry user data.
  constexpr int kSendSigTag = 32766, kExpectTag = 32765;
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  const CheckState* state = FindCheckState(comm);
  const int64_t comm_id = state ? state->id : -1;
  // [what I send, what I expect, what the source sends, what the dest
  // expects]; heap memory: an abandoned wait must not leave MPI writing to
  // the stack.
  auto* w =
      new int64_t[12]{static_cast<int64_t>(send_dtype), send_count, sendtag,
                      static_cast<int64_t>(recv_dtype), recv_count, recvtag,
                      static_cast<int64_t>(recv_dtype), recv_count, recvtag,
                      static_cast<int64_t>(send_dtype), send_count, sendtag};
  int64_t* send_sig = w;
  int64_t* expect = w + 3;
  int64_t* from_source = w + 6;
  int64_t* from_dest = w + 9;
  MPI_Request requests[4];
  DL_MPI_CHECK("signature check", MPI_Irecv(from_source, 3, MPI_INT64_T, source,
                                            kSendSigTag, comm, &requests[0]));
  DL_MPI_CHECK("signature check", MPI_Irecv(from_dest, 3, MPI_INT64_T, dest,
                                            kExpectTag, comm, &requests[1]));
  DL_MPI_CHECK("signature check", MPI_Isend(send_sig, 3, MPI_INT64_T, dest,
                                            kSendSigTag, comm, &requests[2]));
  DL_MPI_CHECK("signature check", MPI_Isend(expect, 3, MPI_INT64_T, source,
                                            kExpectTag, comm, &requests[3]));
  std::string stuck;
  const int peer = source != MPI_PROC_NULL ? source : dest;
  DL_MPI_CHECK("signature check",
               WaitChecking(4, requests, sig, comm_id, peer, &stuck));
  if (!stuck.empty()) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, stuck);
  }
  Text msg;
  bool bad = false;
  // A message may be shorter than the receive buffer (its tail keeps the
  // template), never longer; dtypes and tags must match.
  auto fits = [](const int64_t* sent, const int64_t* expected) {
    return sent[0] == expected[0] && sent[1] <= expected[1] &&
           sent[2] == expected[2];
  };
  if (source != MPI_PROC_NULL && !fits(from_source, expect)) {
    bad = true;
    msg << "\n  rank " << rank << " expects "
        << DescribePair(expect[0], expect[1]) << " with tag " << expect[2]
        << " from rank " << source << ", which sends "
        << DescribePair(from_source[0], from_source[1]) << " with tag "
        << from_source[2];
  }
  if (dest != MPI_PROC_NULL && !fits(send_sig, from_dest)) {
    bad = true;
    msg << "\n  rank " << rank << " sends "
        << DescribePair(send_sig[0], send_sig[1]) << " with tag " << send_sig[2]
        << " to rank " << dest << ", which expects "
        << DescribePair(from_dest[0], from_dest[1]) << " with tag "
        << from_dest[2];
  }
  delete[] w;
  if (!bad) return ffi::Error::Success();
  return ffi::Error(
      ffi::ErrorCode::kInvalidArgument,
      std::string("distlinalg: ") + sig.op() +
          " has mismatched buffers between partners:" + msg.str());
}

// ---------------------------------------------------------------------------
// The responder and the probe.
namespace {

constexpr int kQueryTag = 1, kReplyTag = 2, kPoisonTag = 3;
// Reply: [probe id, phase, comm id, checked, seq, calls started, elapsed ms,
// peer, signature words...]
enum Reply : int {
  kProbeId = 0,
  kPhase,
  kCommId,
  kChecked,
  kSeq,
  kStarted,
  kElapsedMs,
  kPeer,
  kReplySig,
  kReplyWords = kReplySig + Signature::kWords
};

struct Responder {
  MPI_Comm comm = MPI_COMM_NULL;
  std::thread thread;
  std::atomic<bool> stop{false};
  std::atomic<bool> running{false};
  std::atomic<int64_t> probe_ids{0};
};
Responder& TheResponder() {
  static Responder r;
  return r;
}

// This process's oldest call in progress, as a reply.
void DescribeSelf(int64_t probe, int64_t* reply) {
  for (int i = 0; i < kReplyWords; ++i) reply[i] = -1;
  reply[kProbeId] = probe;
  reply[kPhase] = static_cast<int64_t>(Phase::kIdle);
  reply[kStarted] = CallsStarted();
  std::lock_guard<std::mutex> lock(ActiveMutex());
  if (Active().empty()) return;
  const ActiveCall& c = Active().begin()->second;
  reply[kPhase] = static_cast<int64_t>(c.phase);
  const CheckState* state = FindCheckState(CommFromHandle(c.comm));
  reply[kCommId] = state ? state->id : -1;
  reply[kChecked] = c.checked;
  reply[kSeq] = c.seq;
  reply[kElapsedMs] = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::steady_clock::now() - c.start)
                          .count();
  reply[kPeer] = c.root;
  std::memcpy(reply + kReplySig, c.words, sizeof c.words);
}

void Serve() {
  Responder& r = TheResponder();
  int64_t query = 0;
  MPI_Request request;
  MPI_Irecv(&query, 1, MPI_INT64_T, MPI_ANY_SOURCE, kQueryTag, r.comm,
            &request);
  // Another rank found two threads on a communicator (its check id).
  int64_t poisoned_id = 0;
  MPI_Request poison;
  MPI_Irecv(&poisoned_id, 1, MPI_INT64_T, MPI_ANY_SOURCE, kPoisonTag, r.comm,
            &poison);
  while (!r.stop.load()) {
    int done = 0;
    MPI_Status status;
    MPI_Test(&poison, &done, &status);
    if (done) {
      PoisonId(poisoned_id, status.MPI_SOURCE);
      MPI_Irecv(&poisoned_id, 1, MPI_INT64_T, MPI_ANY_SOURCE, kPoisonTag,
                r.comm, &poison);
    }
    done = 0;
    MPI_Test(&request, &done, &status);
    if (!done) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    int64_t reply[kReplyWords];
    DescribeSelf(query, reply);
    MPI_Send(reply, kReplyWords, MPI_INT64_T, status.MPI_SOURCE, kReplyTag,
             r.comm);
    MPI_Irecv(&query, 1, MPI_INT64_T, MPI_ANY_SOURCE, kQueryTag, r.comm,
              &request);
  }
  MPI_Cancel(&request);
  MPI_Wait(&request, MPI_STATUS_IGNORE);
  MPI_Cancel(&poison);
  MPI_Wait(&poison, MPI_STATUS_IGNORE);
}

bool IsPointToPoint(int64_t opcode) {
  return opcode == OpCode("send") || opcode == OpCode("recv") ||
         opcode == OpCode("sendrecv");
}

std::string DescribeState(const int64_t* reply, int world_rank) {
  Text s;
  const auto phase = static_cast<Phase>(reply[kPhase]);
  if (reply[kProbeId] < 0) return "did not answer";
  if (phase == Phase::kIdle) {
    s << "is not in a distlinalg call (" << reply[kStarted]
      << " calls so far): computing, or blocked elsewhere";
    return s.str();
  }
  const std::string what = Describe(reply + kReplySig);
  if (reply[kReplySig] == OpCode("exit")) return "has reached " + what;
  if (phase == Phase::kChecking) {
    s << "waits in the cross-rank check before " << what;
  } else {
    s << "is inside " << what
      << (reply[kChecked] ? " (checked)"
                          : " (not checked: a call site of a compiled program "
                            "that was checked in an earlier run)");
  }
  s << " for " << reply[kElapsedMs] / 1000.0 << " s";
  (void)world_rank;
  return s.str();
}

// Can `other` never meet this rank's check of `mine` on `comm_id`?
bool Blocks(const int64_t* other, const Signature& mine, int64_t comm_id,
            int my_rank, int peer) {
  const auto phase = static_cast<Phase>(other[kPhase]);
  const int64_t op = other[kReplySig];
  if (other[kProbeId] < 0 || phase == Phase::kIdle) return false;
  // A rank at the end of its program never calls anything again: it blocks
  // any call of this rank, but meets this rank's own end-of-program check.
  if (op == OpCode("exit")) return mine.words()[kOpCode] != OpCode("exit");
  // Only calls on the same communicator can be waiting for this one.
  if (comm_id < 0 || other[kCommId] != comm_id) return false;
  const bool other_p2p = IsPointToPoint(op);
  const bool mine_p2p = IsPointToPoint(mine.words()[kOpCode]);
  // A point-to-point call only waits for its partner.
  if (other_p2p && other[kPeer] != my_rank) return false;
  if (mine_p2p && peer >= 0 && other[kPeer] != my_rank) return false;
  if (phase == Phase::kRunning) return !other[kChecked];
  // Both wait in checks on one communicator: they meet unless one is a
  // collective's check and the other a point-to-point call's.
  return other_p2p != mine_p2p;
}

std::string ProbeOtherRanks(const Signature& mine, int64_t comm_id, int peer) {
  Responder& r = TheResponder();
  if (!r.running.load()) return "";
  int size = 0, me = 0;
  MPI_Comm_size(r.comm, &size);
  MPI_Comm_rank(r.comm, &me);
  const int64_t probe = ++r.probe_ids;
  // Leaked on purpose when a rank does not answer (its reply may come later).
  auto* replies = new int64_t[static_cast<size_t>(size) * kReplyWords];
  auto* query = new int64_t(probe);
  std::vector<MPI_Request> recvs(size, MPI_REQUEST_NULL),
      sends(size, MPI_REQUEST_NULL);
  for (int q = 0; q < size; ++q) {
    int64_t* reply = replies + static_cast<size_t>(q) * kReplyWords;
    for (int i = 0; i < kReplyWords; ++i) reply[i] = -1;
    if (q == me) continue;
    MPI_Irecv(reply, kReplyWords, MPI_INT64_T, q, kReplyTag, r.comm, &recvs[q]);
    MPI_Isend(query, 1, MPI_INT64_T, q, kQueryTag, r.comm, &sends[q]);
  }
  const auto deadline = std::chrono::steady_clock::now() + kReplyWait;
  int done = 0;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    MPI_Testall(size, recvs.data(), &done, MPI_STATUSES_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // My rank in the call's communicator, for the partners' peer fields.
  int my_rank = -1;
  {
    std::lock_guard<std::mutex> lock(ActiveMutex());
    for (const auto& [seq, c] : Active()) {
      if (c.phase == Phase::kChecking) my_rank = c.rank;
    }
  }
  std::vector<int> blocking;
  for (int q = 0; q < size; ++q) {
    const int64_t* reply = replies + static_cast<size_t>(q) * kReplyWords;
    if (q != me && reply[kProbeId] == probe &&
        Blocks(reply, mine, comm_id, my_rank, peer)) {
      blocking.push_back(q);
    }
  }
  if (blocking.empty()) {
    if (done) delete[] replies;
    return "";
  }
  Text msg;
  msg << "distlinalg: mismatched communication across ranks: this rank (" << me
      << ") waits to check " << Describe(mine.words()) << ", which rank"
      << (blocking.size() > 1 ? "s " : " ");
  for (size_t i = 0; i < blocking.size(); ++i)
    msg << (i ? ", " : "") << blocking[i];
  msg << " can never join. What each rank is doing (ranks of MPI_COMM_WORLD):";
  for (int q = 0; q < size; ++q) {
    if (q == me) {
      msg << "\n  rank " << q << ": waits in the cross-rank check before "
          << Describe(mine.words());
      continue;
    }
    const int64_t* reply = replies + static_cast<size_t>(q) * kReplyWords;
    msg << "\n  rank " << q << ": "
        << (reply[kProbeId] == probe ? DescribeState(reply, q)
                                     : "did not answer")
        << (std::find(blocking.begin(), blocking.end(), q) != blocking.end()
                ? "   <-- cannot meet this call"
                : "");
  }
  msg << "\nEvery rank must make the same sequence of distlinalg calls (no "
         "collective inside rank-dependent control flow, no call left out on "
         "one rank).";
  return msg.str();
}

}  // namespace

namespace {
// Tells every other rank (their responders) that `id` is poisoned. The
// messages and requests are kept for the life of the process (rare, tiny).
void NotifyPeers(int64_t id) {
  Responder& r = TheResponder();
  if (!r.running.load()) return;
  int size = 0, me = 0;
  MPI_Comm_size(r.comm, &size);
  MPI_Comm_rank(r.comm, &me);
  static std::mutex m;
  static std::vector<int64_t*> messages;
  static std::vector<MPI_Request> sends;
  std::lock_guard<std::mutex> lock(m);
  auto* message = new int64_t(id);
  messages.push_back(message);
  for (int q = 0; q < size; ++q) {
    if (q == me) continue;
    MPI_Request request;
    if (MPI_Isend(message, 1, MPI_INT64_T, q, kPoisonTag, r.comm, &request) ==
        MPI_SUCCESS) {
      sends.push_back(request);
    }
  }
}
}  // namespace

int StartResponder(MPI_Comm world) {
  Responder& r = TheResponder();
  if (r.running.load()) return MPI_SUCCESS;
  int rc = MPI_Comm_dup(world, &r.comm);
  if (rc != MPI_SUCCESS) return rc;
  MPI_Comm_set_errhandler(r.comm, MPI_ERRORS_RETURN);
  MPI_Comm_set_name(r.comm, "distlinalg responder");
  r.stop = false;
  r.thread = std::thread(Serve);
  r.running = true;
  // A program that calls MPI_Finalize itself: MPI deletes COMM_SELF's
  // attributes first, and the responder's receive must be gone by then.
  int keyval = MPI_KEYVAL_INVALID;
  MPI_Comm_create_keyval(
      MPI_COMM_NULL_COPY_FN,
      [](MPI_Comm, int, void*, void*) -> int {
        StopResponder();
        return MPI_SUCCESS;
      },
      &keyval, nullptr);
  MPI_Comm_set_attr(MPI_COMM_SELF, keyval, nullptr);
  return MPI_SUCCESS;
}

void StopResponder() {
  Responder& r = TheResponder();
  if (!r.running.exchange(false)) return;
  r.stop = true;
  if (r.thread.joinable()) r.thread.join();
  MPI_Comm_free(&r.comm);
}

}  // namespace distlinalg
