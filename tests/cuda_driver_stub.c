/* A stand-in for the CUDA driver (libcuda) that works on host memory, so the
 * CUDA handlers' staging logic runs on machines without a GPU
 * (tests/cuda/test_cuda_transport.py, DISTLINALG_CUDA_EMULATION=1).
 *
 * Asynchronous copies are queued and only performed by cuStreamSynchronize
 * (or by cuEventSynchronize, up to the event's place in the queue), and
 * "pinned" host blocks start filled with garbage: a handler that reads a
 * staged buffer before waiting for the stream sees wrong values, which is the
 * bug class this stand-in exists to catch. Counters record what was done.
 *
 * Build: cc -shared -fPIC -O1 -o libcuda_stub.so tests/cuda_driver_stub.c
 * -lpthread
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void* CUstream;

enum { kCopy = 0, kFill = 1 };
struct Pending {
  int kind;
  void* dst;
  const void* src;
  size_t bytes;
  unsigned char value;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
/* g_queue[i] is operation number g_done + i of the stream. */
static struct Pending* g_queue = NULL;
static size_t g_queued = 0, g_capacity = 0;
static unsigned long long g_done = 0;

/* [0] device-to-host bytes, [1] host-to-device bytes, [2] device-to-device
 * bytes, [3] fills, [4] synchronisations, [5] pinned allocations, [6] the
 * largest pinned allocation in bytes, [7] event synchronisations. */
#define STATS 8
static long long g_stats[STATS];

static CUresult Enqueue(int kind, void* dst, const void* src, size_t bytes,
                        unsigned char value, int stat) {
  pthread_mutex_lock(&g_lock);
  if (g_queued == g_capacity) {
    size_t capacity = g_capacity ? 2 * g_capacity : 64;
    struct Pending* grown = realloc(g_queue, capacity * sizeof *grown);
    if (!grown) {
      pthread_mutex_unlock(&g_lock);
      return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    }
    g_queue = grown;
    g_capacity = capacity;
  }
  struct Pending p = {kind, dst, src, bytes, value};
  g_queue[g_queued++] = p;
  g_stats[stat] += kind == kCopy ? (long long)bytes : 1;
  pthread_mutex_unlock(&g_lock);
  return 0;
}

CUresult cuInit(unsigned int flags) {
  (void)flags;
  return 0;
}

CUresult cuDeviceGetCount(int* count) {
  const char* env = getenv("DISTLINALG_STUB_GPUS");
  *count = env ? atoi(env) : 1;
  return 0;
}

CUresult cuGetErrorString(CUresult error, const char** text) {
  *text = error == 0 ? "no error (stub)" : "error (stub driver)";
  return 0;
}

CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes,
                              CUstream stream) {
  (void)stream;
  return Enqueue(kCopy, dst, (const void*)(uintptr_t)src, bytes, 0, 0);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes,
                              CUstream stream) {
  (void)stream;
  return Enqueue(kCopy, (void*)(uintptr_t)dst, src, bytes, 0, 1);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes,
                              CUstream stream) {
  (void)stream;
  return Enqueue(kCopy, (void*)(uintptr_t)dst, (const void*)(uintptr_t)src,
                 bytes, 0, 2);
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t bytes,
                         CUstream stream) {
  (void)stream;
  return Enqueue(kFill, (void*)(uintptr_t)dst, NULL, bytes, value, 3);
}

/* Performs the queued operations numbered below `until` (lock held). */
static void PerformUntil(unsigned long long until) {
  size_t n = until > g_done ? (size_t)(until - g_done) : 0;
  if (n > g_queued) n = g_queued;
  for (size_t i = 0; i < n; ++i) {
    struct Pending* p = &g_queue[i];
    if (p->kind == kCopy) {
      memmove(p->dst, p->src, p->bytes);
    } else {
      memset(p->dst, p->value, p->bytes);
    }
  }
  memmove(g_queue, g_queue + n, (g_queued - n) * sizeof *g_queue);
  g_queued -= n;
  g_done += n;
}

CUresult cuStreamSynchronize(CUstream stream) {
  (void)stream;
  pthread_mutex_lock(&g_lock);
  PerformUntil(g_done + g_queued);
  g_stats[4] += 1;
  pthread_mutex_unlock(&g_lock);
  return 0;
}

/* An event is the number of operations queued when it was recorded. */
typedef unsigned long long* CUevent;

CUresult cuEventCreate(CUevent* event, unsigned int flags) {
  (void)flags;
  *event = calloc(1, sizeof **event);
  return *event ? 0 : 2;
}

CUresult cuEventRecord(CUevent event, CUstream stream) {
  (void)stream;
  pthread_mutex_lock(&g_lock);
  *event = g_done + g_queued;
  pthread_mutex_unlock(&g_lock);
  return 0;
}

CUresult cuEventSynchronize(CUevent event) {
  pthread_mutex_lock(&g_lock);
  PerformUntil(*event);
  g_stats[7] += 1;
  pthread_mutex_unlock(&g_lock);
  return 0;
}

CUresult cuEventDestroy_v2(CUevent event) {
  free(event);
  return 0;
}

CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned int flags) {
  (void)flags;
  *p = malloc(bytes ? bytes : 1);
  if (!*p) return 2;
  memset(*p, 0xA5, bytes); /* garbage until a copy lands */
  pthread_mutex_lock(&g_lock);
  g_stats[5] += 1;
  if ((long long)bytes > g_stats[6]) g_stats[6] = (long long)bytes;
  pthread_mutex_unlock(&g_lock);
  return 0;
}

/* Test hook: copies the counters into out[0..STATS-1]. */
void distlinalg_stub_stats(long long* out) {
  pthread_mutex_lock(&g_lock);
  memcpy(out, g_stats, sizeof g_stats);
  pthread_mutex_unlock(&g_lock);
}

/* Test hook: starts a new measurement of the largest pinned allocation. */
void distlinalg_stub_reset_largest_pinned(void) {
  pthread_mutex_lock(&g_lock);
  g_stats[6] = 0;
  pthread_mutex_unlock(&g_lock);
}
