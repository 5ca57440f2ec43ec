/* The all-reduce of ranks on one host over shared memory: the compiled executor.
 * The protocol and the segment layout are in shm_allreduce.h; the Python twin
 * (shm_twin.py) implements the same, byte for byte.
 *
 * Why a region is safe to reuse at call k + 1 of a bucket, with no extra wait:
 * - my `in` region: peers read it in step 2 of call k, and each publishes its
 *   out_seq = k only after that read. I leave call k only after seeing every
 *   peer's out_seq >= k (step 3), so when I overwrite `in` at call k + 1 no peer
 *   still reads it for call k. No peer reads it for call k + 1 before I publish
 *   in_seq = k + 1, which I do after the copy.
 * - my `out` region: peers read slice r of it in step 3 of call k. I write it
 *   again in step 2 of call k + 1, after seeing every peer's in_seq >= k + 1;
 *   a peer publishes that in step 1 of call k + 1, after it left call k (its
 *   step 3 included). So every peer's reads of call k come first.
 * - my descriptor (count, dtype, op, scale beside in_seq): written at call
 *   k + 1 under the same argument as `in`; a peer reads it in step 2 of call k,
 *   before its out_seq = k.
 * - a pipelined call (run_pipelined) keeps both orders: I leave it after every
 *   peer's last out_progress, which a peer publishes after its last read of my
 *   `in`; a peer writes its `out` at call k + 1 after my in_progress of call k + 1,
 *   which I publish after I left call k.
 * The order is carried by release stores of the sequence numbers and acquire
 * loads of them: every write of call k (data, descriptor) is visible to whoever
 * sees the sequence number k.
 *
 * Waits spin for SPIN_SECONDS, then yield the core until YIELD_SECONDS (a thread
 * sharing this core runs then), then sleep in futex waits on the peer's sequence
 * word (its low 32 bits), in slices of at most SLICE_SECONDS, checking between
 * slices this group's abort, the peer's state word and the timeout. A sleeper
 * sets its segment's `sleeping` word first; a publisher, after its store, reads
 * its peers' `sleeping` words and wakes the word it published if one is set
 * (both sides separated by a sequentially consistent fence, so a sleeper either
 * sees the new value or is woken). A yield that returns only after
 * YIELD_SLOW_SECONDS says another process holds this core (each yield can hand
 * it a whole time slice: milliseconds per call): the executor then skips the
 * yields and sleeps at once, for CONTENDED_SECONDS. The Python twin never sleeps in a futex
 * (it polls), and wakes after every publication.
 */
#define _GNU_SOURCE
#include "shm_allreduce.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define LINE 64u
#define OFF_STATE 64u
#define OFF_SLEEPING 128u
#define OFF_BUCKETS 192u
#define BUCKET_STRIDE 128u
#ifndef SPIN_SECONDS
#define SPIN_SECONDS 5e-6
#endif
#ifndef YIELD_SECONDS
#define YIELD_SECONDS 1e-3
#endif
#ifndef IDLE_SPIN_SECONDS
#define IDLE_SPIN_SECONDS 200e-6
#endif
#ifndef YIELD_SLOW_SECONDS
#define YIELD_SLOW_SECONDS 1e-3
#endif
#define CONTENDED_SECONDS 0.1
#define LAST_SUBMITS 16u
#define SLICE_SECONDS 0.05

typedef struct request {
  struct request *next;
  uint64_t id;
  uint32_t bucket;
  const void *in;
  void *out;
  uint64_t count;
  /* the input and the output as `parts` buffers back to back (the caller's arrays,
   * kept until done; a plain request's are its own in, out and count) */
  int parts;
  const void *const *ins;
  void *const *outs;
  const uint64_t *counts;
  int dtype, op;
  double scale;
  char label[96];
  rdt_shm_done_fn done;
  void *arg;
  uint64_t k; /* its call number on its bucket, once step 1 ran */
  int status;
  char msg[RDT_SHM_MESSAGE];
} request;

struct rdt_shm_group {
  int rank, ranks;
  uint32_t buckets;
  double timeout;
  uint64_t total;
  uint64_t *bucket_bytes;
  uint64_t *in_off; /* the `in` region of bucket b; `out` follows at align64(bytes) */
  unsigned char **base;
  uint64_t *calls; /* calls made per bucket: the executor thread's alone */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  request *head, *tail; /* queued */
  request *spare;       /* completed requests, for reuse (no malloc per request) */
  request *wave;        /* taken by the executor, not completed yet */
  unsigned char *in_wave;
  uint64_t next_id;
  int closing;
  _Atomic int queued;
  _Atomic int aborted; /* 0, or the status the group was aborted with */
  char why[RDT_SHM_MESSAGE];
  _Atomic(uint32_t *) wait_addr;
  _Atomic int refs;
  _Atomic uint64_t done_calls, moved_bytes; /* calls completed, bytes each moved to and from peers */
  /* overlap: when the last bucket's latest calls were submitted (under mu; a round
   * ends with its last bucket, handed over when backprop made its gradients), and
   * the executor's time on waves, of it before its round's last bucket came */
  uint64_t last_submits;
  double last_submit_at[LAST_SUBMITS];
  double busy_seconds, overlapped_seconds; /* under mu */
  pthread_t thread;
  pid_t tid; /* the executor thread's, once it runs (under mu) */
  int started;
  double contended_until; /* the executor thread's alone: no yields before then */
};

/* ----------------------------------------------------------------- helpers */
static uint64_t align64(uint64_t x) { return (x + 63u) & ~(uint64_t)63u; }

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void say(char *buf, size_t len, const char *fmt, ...) {
  if (buf == NULL || len == 0) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, len, fmt, ap);
  va_end(ap);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  atomic_signal_fence(memory_order_seq_cst);
#endif
}

static void futex_wait(uint32_t *addr, uint32_t value, double seconds) {
  struct timespec ts;
  ts.tv_sec = (time_t)seconds;
  ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
  syscall(SYS_futex, addr, FUTEX_WAIT, value, &ts, NULL, 0);
}

/* Yield the core to a thread that shares it; 0 (sleep instead) while another
 * process holds it, which a slow yield shows. */
static int yield_core(rdt_shm_group *g, double t) {
  if (t < g->contended_until) return 0;
  sched_yield();
  double after = now_seconds();
  if (after - t <= YIELD_SLOW_SECONDS) return 1;
  g->contended_until = after + CONTENDED_SECONDS;
  return 0;
}

static void futex_wake(uint32_t *addr) { syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

static size_t dtype_size(int dtype) {
  switch (dtype) {
    case RDT_SHM_FLOAT32: return 4;
    case RDT_SHM_FLOAT64: return 8;
    case RDT_SHM_INT32: return 4;
    case RDT_SHM_INT64: return 8;
    case RDT_SHM_FLOAT16: return 2;
    default: return 0;
  }
}

static const char *dtype_name(int dtype) {
  switch (dtype) {
    case RDT_SHM_FLOAT32: return "float32";
    case RDT_SHM_FLOAT64: return "float64";
    case RDT_SHM_INT32: return "int32";
    case RDT_SHM_INT64: return "int64";
    case RDT_SHM_FLOAT16: return "float16";
    default: return "an unknown dtype";
  }
}

static const char *op_name(int op) {
  switch (op) {
    case RDT_SHM_SUM: return "sum";
    case RDT_SHM_AVERAGE: return "average";
    case RDT_SHM_MIN: return "min";
    case RDT_SHM_MAX: return "max";
    case RDT_SHM_PRODUCT: return "product";
    default: return "an unknown op";
  }
}

/* --------------------------------------------------------------- the layout */
static uint64_t layout_checksum(uint32_t buckets, const uint64_t *bytes) {
  uint64_t h = 1469598103934665603ULL; /* FNV-1a over the sizes, 8 bytes each, little-endian */
  for (uint32_t b = 0; b < buckets; b++)
    for (int i = 0; i < 8; i++) {
      h ^= (bytes[b] >> (8 * i)) & 0xffu;
      h *= 1099511628211ULL;
    }
  return h;
}

uint64_t rdt_shm_segment_bytes(uint32_t buckets, const uint64_t *bucket_bytes) {
  uint64_t off = align64(OFF_BUCKETS + (uint64_t)BUCKET_STRIDE * buckets);
  for (uint32_t b = 0; b < buckets; b++) {
    if (bucket_bytes[b] > (UINT64_MAX >> 4)) return 0;
    uint64_t region = align64(bucket_bytes[b]);
    if (off > UINT64_MAX - 2 * region) return 0;
    off += 2 * region;
  }
  return off;
}

static unsigned char *in_line(const rdt_shm_group *g, int r, uint32_t b) {
  return g->base[r] + OFF_BUCKETS + (uint64_t)BUCKET_STRIDE * b;
}
static _Atomic uint64_t *in_seq(const rdt_shm_group *g, int r, uint32_t b) {
  return (_Atomic uint64_t *)in_line(g, r, b);
}
static _Atomic uint64_t *out_seq(const rdt_shm_group *g, int r, uint32_t b) {
  return (_Atomic uint64_t *)(in_line(g, r, b) + LINE);
}
/* A pipelined call's progress beside each sequence word: (k << 24) | chunks done
 * (PROGRESS_DONE: all of them; published by every call, pipelined or not). */
#define PROGRESS_DONE 0xFFFFFFu
static _Atomic uint64_t *in_progress(const rdt_shm_group *g, int r, uint32_t b) {
  return (_Atomic uint64_t *)(in_line(g, r, b) + 32);
}
static _Atomic uint64_t *out_progress(const rdt_shm_group *g, int r, uint32_t b) {
  return (_Atomic uint64_t *)(in_line(g, r, b) + LINE + 8);
}
static uint64_t progress(uint64_t k, uint64_t chunks) { return (k << 24) | chunks; }
static _Atomic uint32_t *state_word(const rdt_shm_group *g, int r) {
  return (_Atomic uint32_t *)(g->base[r] + OFF_STATE);
}
static _Atomic uint32_t *sleeping_word(const rdt_shm_group *g, int r) {
  return (_Atomic uint32_t *)(g->base[r] + OFF_SLEEPING);
}
static unsigned char *in_region(const rdt_shm_group *g, int r, uint32_t b) { return g->base[r] + g->in_off[b]; }
static unsigned char *out_region(const rdt_shm_group *g, int r, uint32_t b) {
  return g->base[r] + g->in_off[b] + align64(g->bucket_bytes[b]);
}

/* [lo, hi) of slice `r` of `count` elements cut into `n` (as schedule.ring_bounds) */
static void slice_of(uint64_t count, int n, int r, uint64_t *lo, uint64_t *hi) {
  uint64_t q = count / (uint64_t)n, rem = count % (uint64_t)n, ur = (uint64_t)r;
  *lo = ur * q + (ur < rem ? ur : rem);
  *hi = *lo + q + (ur < rem ? 1 : 0);
}

/* ---------------------------------------------------------------- reducing */
/* out[i] = combine(out[i], x[i]), in the element's own precision, as numpy's
 * np.add / np.minimum / np.maximum / np.multiply compute it (integers wrap). */
#define COMBINE_FLOAT(T, SUFFIX)                                                          \
  static void combine_##SUFFIX(T *restrict out, const T *restrict x, uint64_t n, int op) { \
    switch (op) {                                                                         \
      case RDT_SHM_SUM:                                                                   \
      case RDT_SHM_AVERAGE:                                                               \
        for (uint64_t i = 0; i < n; i++) out[i] = out[i] + x[i];                          \
        break;                                                                            \
      case RDT_SHM_PRODUCT:                                                               \
        for (uint64_t i = 0; i < n; i++) out[i] = out[i] * x[i];                          \
        break;                                                                            \
      case RDT_SHM_MIN: /* a NaN on either side wins, as np.minimum */                    \
        for (uint64_t i = 0; i < n; i++) out[i] = (out[i] < x[i] || out[i] != out[i]) ? out[i] : x[i]; \
        break;                                                                            \
      case RDT_SHM_MAX:                                                                   \
        for (uint64_t i = 0; i < n; i++) out[i] = (out[i] > x[i] || out[i] != out[i]) ? out[i] : x[i]; \
        break;                                                                            \
    }                                                                                     \
  }
#define COMBINE_INT(T, U, SUFFIX)                                                         \
  static void combine_##SUFFIX(T *restrict out, const T *restrict x, uint64_t n, int op) { \
    switch (op) {                                                                         \
      case RDT_SHM_SUM:                                                                   \
      case RDT_SHM_AVERAGE:                                                               \
        for (uint64_t i = 0; i < n; i++) out[i] = (T)((U)out[i] + (U)x[i]);               \
        break;                                                                            \
      case RDT_SHM_PRODUCT:                                                               \
        for (uint64_t i = 0; i < n; i++) out[i] = (T)((U)out[i] * (U)x[i]);               \
        break;                                                                            \
      case RDT_SHM_MIN:                                                                   \
        for (uint64_t i = 0; i < n; i++) out[i] = out[i] < x[i] ? out[i] : x[i];          \
        break;                                                                            \
      case RDT_SHM_MAX:                                                                   \
        for (uint64_t i = 0; i < n; i++) out[i] = out[i] > x[i] ? out[i] : x[i];          \
        break;                                                                            \
    }                                                                                     \
  }
/* float16 as numpy computes it: each operation in float32, rounded to half
 * (to nearest, ties to even). With float's 24 bits against half's 11, that
 * double rounding gives the correctly rounded half result. */
static inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else { /* subnormal: normalize */
      exp = 113;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        exp--;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t float_to_half(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u, abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) { /* inf, NaN (its top payload bits kept, as numpy) */
    if (abs == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
    uint32_t h = 0x7c00u + ((abs & 0x7fffffu) >> 13);
    return (uint16_t)(sign | (h == 0x7c00u ? h + 1 : h));
  }
  if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* 65520 and above: inf */
  if (abs < 0x38800000u) {                                     /* below 2^-14: a subnormal half, or 0 */
    if (abs <= 0x33000000u) return (uint16_t)sign;             /* 2^-25 and below: 0 (ties to even) */
    uint32_t e = abs >> 23, m = (abs & 0x7fffffu) | 0x800000u, shift = 126 - e;
    uint32_t h = m >> shift, rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1u))) h++;
    return (uint16_t)(sign | h);
  }
  uint32_t h = (abs >> 13) - (112u << 10), rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; /* a carry may reach inf: right */
  return (uint16_t)(sign | h);
}

static void combine_f16(uint16_t *restrict out, const uint16_t *restrict x, uint64_t n, int op) {
  for (uint64_t i = 0; i < n; i++) {
    float a = half_to_float(out[i]), b = half_to_float(x[i]);
    switch (op) {
      case RDT_SHM_SUM:
      case RDT_SHM_AVERAGE: out[i] = float_to_half(a + b); break;
      case RDT_SHM_PRODUCT: out[i] = float_to_half(a * b); break;
      case RDT_SHM_MIN: out[i] = (a < b || a != a) ? out[i] : x[i]; break;
      case RDT_SHM_MAX: out[i] = (a > b || a != a) ? out[i] : x[i]; break;
    }
  }
}

COMBINE_FLOAT(float, f32)
COMBINE_FLOAT(double, f64)
COMBINE_INT(int32_t, uint32_t, i32)
COMBINE_INT(int64_t, uint64_t, i64)

/* As tf_plugin/core/scaling.py: float32 times the factor rounded to float32, in
 * float32; float16 the same, rounded back to half; float64 in double; integers
 * in double, truncated toward zero. */
static void scale_slice(void *p, uint64_t n, int dtype, double factor) {
  switch (dtype) {
    case RDT_SHM_FLOAT32: {
      float *x = p, f = (float)factor;
      for (uint64_t i = 0; i < n; i++) x[i] = x[i] * f;
      break;
    }
    case RDT_SHM_FLOAT64: {
      double *x = p;
      for (uint64_t i = 0; i < n; i++) x[i] = x[i] * factor;
      break;
    }
    case RDT_SHM_INT32: {
      int32_t *x = p;
      for (uint64_t i = 0; i < n; i++) x[i] = (int32_t)((double)x[i] * factor);
      break;
    }
    case RDT_SHM_INT64: {
      int64_t *x = p;
      for (uint64_t i = 0; i < n; i++) x[i] = (int64_t)((double)x[i] * factor);
      break;
    }
    case RDT_SHM_FLOAT16: { /* in float32, rounded back to half */
      uint16_t *x = p;
      float f = (float)factor;
      for (uint64_t i = 0; i < n; i++) x[i] = float_to_half(half_to_float(x[i]) * f);
      break;
    }
  }
}

static void combine(void *out, const void *x, uint64_t n, int dtype, int op) {
  switch (dtype) {
    case RDT_SHM_FLOAT32: combine_f32(out, x, n, op); break;
    case RDT_SHM_FLOAT64: combine_f64(out, x, n, op); break;
    case RDT_SHM_INT32: combine_i32(out, x, n, op); break;
    case RDT_SHM_INT64: combine_i64(out, x, n, op); break;
    case RDT_SHM_FLOAT16: combine_f16(out, x, n, op); break;
  }
}

/* --------------------------------------------------------- abort and waits */
static void wake_everyone(rdt_shm_group *g) {
  uint32_t *w = atomic_load(&g->wait_addr);
  if (w != NULL) futex_wake(w);
  for (uint32_t b = 0; b < g->buckets; b++) {
    futex_wake((uint32_t *)in_seq(g, g->rank, b));
    futex_wake((uint32_t *)out_seq(g, g->rank, b));
  }
}

void rdt_shm_group_abort(rdt_shm_group *g, int status, const char *why) {
  if (status == RDT_SHM_OK) status = RDT_SHM_ABORTED;
  pthread_mutex_lock(&g->mu);
  int first = atomic_load(&g->aborted) == 0;
  if (first) {
    say(g->why, sizeof g->why, "%s", why ? why : "aborted");
    atomic_store(&g->aborted, status);
  }
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
  if (!first) return;
  atomic_store_explicit(state_word(g, g->rank), (uint32_t)status, memory_order_release);
  atomic_thread_fence(memory_order_seq_cst);
  wake_everyone(g);
}

int rdt_shm_group_status(rdt_shm_group *g) { return atomic_load(&g->aborted); }

int rdt_shm_group_peer_ahead(rdt_shm_group *g, uint32_t *bucket, uint64_t *call) {
  pthread_mutex_lock(&g->mu);
  int pending = g->head != NULL || g->wave != NULL;
  pthread_mutex_unlock(&g->mu);
  if (pending || atomic_load(&g->aborted)) return -1;
  for (uint32_t b = 0; b < g->buckets; b++) {
    uint64_t mine = atomic_load_explicit(in_seq(g, g->rank, b), memory_order_acquire);
    for (int r = 0; r < g->ranks; r++) {
      uint64_t theirs = r == g->rank ? 0 : atomic_load_explicit(in_seq(g, r, b), memory_order_acquire);
      if (theirs > mine) {
        *bucket = b;
        *call = theirs;
        return r;
      }
    }
  }
  return -1;
}

void rdt_shm_group_counters(rdt_shm_group *g, uint64_t *calls, uint64_t *bytes) {
  *calls = atomic_load(&g->done_calls);
  *bytes = atomic_load(&g->moved_bytes);
}

void rdt_shm_group_busy(rdt_shm_group *g, double *busy, double *overlapped) {
  pthread_mutex_lock(&g->mu);
  *busy = g->busy_seconds;
  *overlapped = g->overlapped_seconds;
  pthread_mutex_unlock(&g->mu);
}

/* What a completed call moved across this rank's boundary, either way: in step 2 it
 * reads its slice from each of n-1 peers and they read everything else of its input;
 * in step 3 it reads everything else of the result and each peer reads its slice. */
static uint64_t moved_by(const rdt_shm_group *g, const request *r) {
  uint64_t lo, hi;
  slice_of(r->count, g->ranks, g->rank, &lo, &hi);
  return ((uint64_t)(g->ranks - 1) * (hi - lo) + (r->count - (hi - lo))) * dtype_size(r->dtype);
}

/* The status a request fails with once the group is aborted, and its message. */
static int aborted_status(rdt_shm_group *g, const request *r, char *msg) {
  pthread_mutex_lock(&g->mu);
  int st = atomic_load(&g->aborted);
  say(msg, RDT_SHM_MESSAGE, "rdmatensor shm all-reduce of %s (bucket %u) not done: %s", r->label, r->bucket,
      g->why);
  pthread_mutex_unlock(&g->mu);
  return st;
}

/* Wait until `seq` (in peer's segment) reaches k, or fail: the group aborted, the
 * peer aborted, or the deadline passed. */
static int wait_for(rdt_shm_group *g, const request *r, int peer, _Atomic uint64_t *seq, uint64_t k,
                    const char *what, double deadline, char *msg) {
  if (atomic_load_explicit(seq, memory_order_acquire) >= k) return RDT_SHM_OK;
  double start = now_seconds();
  for (unsigned i = 1;; i++) {
    if (atomic_load_explicit(seq, memory_order_acquire) >= k) return RDT_SHM_OK;
    if ((i & 31u) == 0) {
      if (atomic_load_explicit(&g->aborted, memory_order_relaxed)) break;
      double t = now_seconds(), waited = t - start;
      if (waited > YIELD_SECONDS) break;
      if (waited > SPIN_SECONDS) { /* a thread on this core gets to run */
        if (!yield_core(g, t)) break;
        continue;
      }
    }
    cpu_relax();
  }
  _Atomic uint32_t *sleeping = sleeping_word(g, g->rank);
  for (;;) {
    uint64_t v = atomic_load_explicit(seq, memory_order_acquire);
    if (v >= k) return RDT_SHM_OK;
    if (atomic_load(&g->aborted)) return aborted_status(g, r, msg);
    uint32_t peer_state = atomic_load_explicit(state_word(g, peer), memory_order_acquire);
    if (peer_state == RDT_SHM_MISMATCH) { /* the peer saw the ranks call different collectives */
      say(msg, RDT_SHM_MESSAGE,
          "rdmatensor shm all-reduce of %s (bucket %u, call %llu): rank %d found that the ranks called different "
          "collectives while rank %d waited for its %s",
          r->label, r->bucket, (unsigned long long)r->k, peer, g->rank, what);
      return RDT_SHM_MISMATCH;
    }
    if (peer_state != 0) {
      say(msg, RDT_SHM_MESSAGE,
          "rdmatensor shm all-reduce of %s (bucket %u, call %llu): rank %d aborted its group (status %u) "
          "while rank %d waited for its %s",
          r->label, r->bucket, (unsigned long long)r->k, peer, peer_state, g->rank, what);
      return RDT_SHM_PEER_ABORTED;
    }
    double left = deadline - now_seconds();
    if (left <= 0) {
      say(msg, RDT_SHM_MESSAGE,
          "rdmatensor shm all-reduce of %s (bucket %u, call %llu): rank %d did not arrive within %g s "
          "(rank %d waited for its %s)",
          r->label, r->bucket, (unsigned long long)r->k, peer, g->timeout, g->rank, what);
      return RDT_SHM_TIMEOUT;
    }
    atomic_store_explicit(sleeping, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    v = atomic_load_explicit(seq, memory_order_acquire);
    if (v < k && !atomic_load(&g->aborted)) {
      atomic_store(&g->wait_addr, (uint32_t *)seq);
      futex_wait((uint32_t *)seq, (uint32_t)v, left < SLICE_SECONDS ? left : SLICE_SECONDS);
      atomic_store(&g->wait_addr, NULL);
    }
    atomic_store_explicit(sleeping, 0, memory_order_relaxed);
  }
}

/* Store k, then wake a peer that sleeps (on this word or any other). */
static void publish(rdt_shm_group *g, _Atomic uint64_t *seq, uint64_t k) {
  atomic_store_explicit(seq, k, memory_order_release);
  atomic_thread_fence(memory_order_seq_cst);
  for (int p = 0; p < g->ranks; p++)
    if (p != g->rank && atomic_load_explicit(sleeping_word(g, p), memory_order_relaxed)) {
      futex_wake((uint32_t *)seq);
      return;
    }
}

/* --------------------------------------------------------- one all-reduce */
struct descriptor {
  uint64_t count;
  uint32_t dtype, op;
  double scale;
};

static struct descriptor descriptor_of(const rdt_shm_group *g, int r, uint32_t b) {
  struct descriptor d;
  memcpy(&d, in_line(g, r, b) + 8, sizeof d);
  return d;
}

/* Elements [lo, hi) of the input, from its parts, into `region` (a rank's `in`). */
static void gather(const request *r, unsigned char *region, uint64_t lo, uint64_t hi, size_t esize) {
  uint64_t start = 0;
  for (int i = 0; i < r->parts && start < hi; start += r->counts[i], i++) {
    const uint64_t a = lo > start ? lo : start, z = hi < start + r->counts[i] ? hi : start + r->counts[i];
    if (z > a) memcpy(region + a * esize, (const unsigned char *)r->ins[i] + (a - start) * esize, (z - a) * esize);
  }
}

/* Step 1 of request r: my input into my `in`, the descriptor, in_seq = k. My own
 * slice stays out: no peer reads it (each reduces its own slice), and step 2
 * reads it from the input itself. */
static void step_in(rdt_shm_group *g, request *r) {
  const uint32_t b = r->bucket;
  r->k = ++g->calls[b];
  const size_t esize = dtype_size(r->dtype);
  uint64_t lo, hi;
  slice_of(r->count, g->ranks, g->rank, &lo, &hi);
  gather(r, in_region(g, g->rank, b), 0, lo, esize);
  gather(r, in_region(g, g->rank, b), hi, r->count, esize);
  struct descriptor mine = {r->count, (uint32_t)r->dtype, (uint32_t)r->op, r->scale};
  memcpy(in_line(g, g->rank, b) + 8, &mine, sizeof mine);
  publish(g, in_seq(g, g->rank, b), r->k);
  publish(g, in_progress(g, g->rank, b), progress(r->k, PROGRESS_DONE));
}

/* Whether peer p's descriptor of this call is mine; else the mismatch in r->msg. */
static int same_call(rdt_shm_group *g, request *r, int p) {
  struct descriptor theirs = descriptor_of(g, p, r->bucket);
  if (theirs.count == r->count && theirs.dtype == (uint32_t)r->dtype && theirs.op == (uint32_t)r->op &&
      memcmp(&theirs.scale, &r->scale, sizeof r->scale) == 0)
    return RDT_SHM_OK;
  say(r->msg, RDT_SHM_MESSAGE,
      "rdmatensor shm all-reduce of %s (bucket %u, call %llu): rank %d all-reduces %llu elements of %s "
      "(%s, scale %g), rank %d %llu elements of %s (%s, scale %g): every rank must call the same "
      "all-reduces in the same order",
      r->label, r->bucket, (unsigned long long)r->k, p, (unsigned long long)theirs.count,
      dtype_name((int)theirs.dtype), op_name((int)theirs.op), theirs.scale, g->rank, (unsigned long long)r->count,
      dtype_name(r->dtype), op_name(r->op), r->scale);
  return RDT_SHM_MISMATCH;
}

/* Elements [lo, hi) of my slice of the result into my `out`: the ranks' inputs
 * folded in rank order (mine read from the input's parts), scaled. */
static void reduce_range(rdt_shm_group *g, request *r, uint64_t lo, uint64_t hi) {
  const uint32_t b = r->bucket;
  const int me = g->rank;
  const size_t esize = dtype_size(r->dtype);
  const double factor = r->op == RDT_SHM_AVERAGE ? r->scale / (double)g->ranks : r->scale;
  uint64_t start = 0;
  for (int i = 0; i < r->parts && start < hi; start += r->counts[i], i++) {
    const uint64_t a = lo > start ? lo : start, z = hi < start + r->counts[i] ? hi : start + r->counts[i];
    if (z <= a) continue;
    const unsigned char *own = (const unsigned char *)r->ins[i] + (a - start) * esize;
    unsigned char *to = out_region(g, me, b) + a * esize;
    memcpy(to, me == 0 ? own : in_region(g, 0, b) + a * esize, (z - a) * esize);
    for (int p = 1; p < g->ranks; p++)
      combine(to, p == me ? own : in_region(g, p, b) + a * esize, z - a, r->dtype, r->op);
    if (factor != 1.0) scale_slice(to, z - a, r->dtype, factor);
  }
}

/* Step 2: every peer's input, then my slice of the result into my `out`, out_seq = k. */
static int step_reduce(rdt_shm_group *g, request *r) {
  const uint32_t b = r->bucket;
  const int me = g->rank, n = g->ranks;
  double deadline = now_seconds() + g->timeout;
  int st;
  for (int p = 0; p < n; p++) {
    if (p == me) continue;
    if ((st = wait_for(g, r, p, in_seq(g, p, b), r->k, "input", deadline, r->msg)) != RDT_SHM_OK) return st;
    if ((st = same_call(g, r, p)) != RDT_SHM_OK) return st;
  }
  uint64_t lo, hi;
  slice_of(r->count, n, me, &lo, &hi);
  reduce_range(g, r, lo, hi);
  publish(g, out_seq(g, me, b), r->k);
  publish(g, out_progress(g, me, b), progress(r->k, PROGRESS_DONE));
  return RDT_SHM_OK;
}

/* Elements [lo, hi) of the result, from `region` (a rank's `out`), into the output's parts. */
static void scatter(const request *r, const unsigned char *region, uint64_t lo, uint64_t hi, size_t esize) {
  uint64_t start = 0;
  for (int i = 0; i < r->parts && start < hi; start += r->counts[i], i++) {
    const uint64_t a = lo > start ? lo : start, z = hi < start + r->counts[i] ? hi : start + r->counts[i];
    if (z > a) memcpy((unsigned char *)r->outs[i] + (a - start) * esize, region + a * esize, (z - a) * esize);
  }
}

/* Step 3: every rank's slice of the result into the output. */
static int step_out(rdt_shm_group *g, request *r) {
  const uint32_t b = r->bucket;
  const int me = g->rank, n = g->ranks;
  const size_t esize = dtype_size(r->dtype);
  uint64_t lo, hi;
  slice_of(r->count, n, me, &lo, &hi);
  scatter(r, out_region(g, me, b), lo, hi, esize);
  double deadline = now_seconds() + g->timeout;
  int st;
  for (int p = 0; p < n; p++) {
    if (p == me) continue;
    if ((st = wait_for(g, r, p, out_seq(g, p, b), r->k, "result", deadline, r->msg)) != RDT_SHM_OK) return st;
    slice_of(r->count, n, p, &lo, &hi);
    scatter(r, out_region(g, p, b), lo, hi, esize);
  }
  return RDT_SHM_OK;
}

/* A large call runs pipelined: each rank's slice cut in chunks of RDT_SHM_PIPELINE_BYTES,
 * chunk j's input copied in, then reduced, then copied out, a chunk apart
 * (copy in j, reduce j - 1, copy out j - 2), each stage published in the
 * progress words. What a peer reads was written a moment before, in the caches
 * the cores share, not fetched back from memory as a whole bucket's steps do.
 * The chunks it takes (at least 2 pipelines it; 0: not pipelined). */
static uint64_t pipeline_chunks(const rdt_shm_group *g, const request *r) {
  const uint64_t per = RDT_SHM_PIPELINE_BYTES / dtype_size(r->dtype);
  const uint64_t widest = (r->count + (uint64_t)g->ranks - 1) / (uint64_t)g->ranks;
  if (per == 0 || widest <= per) return 0;
  return (widest + per - 1) / per;
}

/* Chunk j of slice p: [lo, hi). */
static void chunk_of(const rdt_shm_group *g, const request *r, int p, uint64_t j, uint64_t *lo, uint64_t *hi) {
  const uint64_t per = RDT_SHM_PIPELINE_BYTES / dtype_size(r->dtype);
  uint64_t slo, shi;
  slice_of(r->count, g->ranks, p, &slo, &shi);
  *lo = slo + j * per < shi ? slo + j * per : shi;
  *hi = *lo + per < shi ? *lo + per : shi;
}

/* Steps 1-3 of a large call, chunk by chunk (pipeline_chunks). No deadlock: a rank
 * in round t has published its input of chunks 0..t and results of 0..t-2; it
 * waits for its peers' input of chunk t-1 and results of t-2, which a peer in
 * round t or later has published, and the ranks in the lowest round wait on
 * nothing unpublished. A peer that calls something else (a mismatch) publishes
 * its progress done at once, so the descriptor check below sees it. */
static int run_pipelined(rdt_shm_group *g, request *r, uint64_t chunks) {
  const uint32_t b = r->bucket;
  const int me = g->rank, n = g->ranks;
  const size_t esize = dtype_size(r->dtype);
  r->k = ++g->calls[b];
  const uint64_t k = r->k;
  struct descriptor mine = {r->count, (uint32_t)r->dtype, (uint32_t)r->op, r->scale};
  memcpy(in_line(g, me, b) + 8, &mine, sizeof mine);
  uint64_t lo, hi;
  int st;
  for (uint64_t t = 0; t < chunks + 2; t++) {
    const double deadline = now_seconds() + g->timeout; /* a peer that keeps up is alive */
    if (t < chunks) { /* step 1 of chunk t: every slice's part of it */
      for (int p = 0; p < n; p++) {
        if (p == me) continue; /* my own slice is read from the input (reduce_range) */
        chunk_of(g, r, p, t, &lo, &hi);
        gather(r, in_region(g, me, b), lo, hi, esize);
      }
      publish(g, in_progress(g, me, b), progress(k, t + 1));
      if (t + 1 == chunks) publish(g, in_seq(g, me, b), k);
    }
    if (t >= 1 && t - 1 < chunks) { /* step 2 of chunk t - 1 */
      for (int p = 0; p < n; p++) {
        if (p == me) continue;
        if ((st = wait_for(g, r, p, in_progress(g, p, b), progress(k, t), "input", deadline, r->msg)) != RDT_SHM_OK)
          return st;
        if (t == 1 && (st = same_call(g, r, p)) != RDT_SHM_OK) return st;
      }
      chunk_of(g, r, me, t - 1, &lo, &hi);
      reduce_range(g, r, lo, hi);
      publish(g, out_progress(g, me, b), progress(k, t));
      if (t == chunks) publish(g, out_seq(g, me, b), k);
    }
    if (t >= 2) { /* step 3 of chunk t - 2 */
      for (int p = 0; p < n; p++) {
        if (p != me &&
            (st = wait_for(g, r, p, out_progress(g, p, b), progress(k, t - 1), "result", deadline, r->msg)) !=
                RDT_SHM_OK)
          return st;
        chunk_of(g, r, p, t - 2, &lo, &hi);
        scatter(r, out_region(g, p, b), lo, hi, esize);
      }
    }
  }
  return RDT_SHM_OK;
}

/* --------------------------------------------------------- the executor */
/* The executor runs requests in waves: the longest prefix of the queue whose
 * buckets are distinct (at most MAX_WAVE), step 1 of each, then step 2 of each,
 * then step 3 of each, completing them in order. A wave waits for a peer about
 * twice, not twice per request. It keeps the protocol: a bucket's calls stay in
 * order (one per wave), and no deadlock: every rank runs the same requests in
 * the same order, a wave's step 2 publishes each result before waiting on the
 * next request's inputs, and whatever a wait of step 2 or 3 needs from a peer,
 * the peer publishes before it waits on anything of a later request. */
#define MAX_WAVE 256

static request *next_wave(rdt_shm_group *g) {
  /* a step submits in bursts: spin a little, then yield the core a while, before
   * sleeping on the condition (a thread of TensorFlow on this core runs meanwhile) */
  double start = 0;
  for (unsigned i = 1; atomic_load_explicit(&g->queued, memory_order_acquire) == 0; i++) {
    if ((i & 31u) == 0) {
      double t = now_seconds();
      if (start == 0) {
        start = t;
      } else if (t - start > IDLE_SPIN_SECONDS) {
        break;
      } else if (t - start > SPIN_SECONDS) {
        if (!yield_core(g, t)) break;
        continue;
      }
    }
    cpu_relax();
  }
  pthread_mutex_lock(&g->mu);
  while (g->head == NULL && !g->closing) pthread_cond_wait(&g->cv, &g->mu);
  request *first = g->head, *last = NULL;
  int taken = 0;
  for (request *r = g->head; r != NULL && taken < MAX_WAVE && !g->in_wave[r->bucket]; r = r->next) {
    const int alone = pipeline_chunks(g, r) > 0; /* a pipelined call is a wave of its own */
    if (alone && taken > 0) break;
    g->in_wave[r->bucket] = 1;
    last = r;
    taken++;
    if (alone) break;
  }
  if (last != NULL) {
    g->head = last->next;
    if (g->head == NULL) g->tail = NULL;
    last->next = NULL;
    atomic_fetch_sub(&g->queued, taken);
    for (request *r = first; r != NULL; r = r->next) g->in_wave[r->bucket] = 0;
  } else {
    first = NULL;
  }
  g->wave = first;
  pthread_mutex_unlock(&g->mu);
  return first;
}

static void fail(rdt_shm_group *g, request *r, int status) {
  r->status = status;
  if (!atomic_load(&g->aborted)) {
    /* a call left half done puts the ranks out of step: no later one may run */
    char why[RDT_SHM_MESSAGE];
    say(why, sizeof why, "another all-reduce of this group failed (%.250s)", r->msg);
    rdt_shm_group_abort(g, RDT_SHM_ABORTED, why);
  }
}

/* A wave's time from t0 to t1 into the busy counters: the share of it before its
 * round's last bucket was submitted is overlapped (the round of its first request,
 * its call number k; that bucket not yet submitted: all of it; submitted so long ago
 * that the ring forgot when: none of it). */
static void account(rdt_shm_group *g, uint64_t k, double t0, double t1) {
  if (k == 0) return; /* failed before step 1 */
  pthread_mutex_lock(&g->mu);
  double before = t1 - t0;
  if (g->last_submits >= k) {
    before = 0;
    if (g->last_submits - k < LAST_SUBMITS) {
      double at = g->last_submit_at[(k - 1) % LAST_SUBMITS];
      before = at <= t0 ? 0 : (at >= t1 ? t1 - t0 : at - t0);
    }
  }
  g->busy_seconds += t1 - t0;
  g->overlapped_seconds += before;
  pthread_mutex_unlock(&g->mu);
}

static void *executor(void *arg) {
  rdt_shm_group *g = arg;
  request *wave;
  pthread_mutex_lock(&g->mu);
  g->tid = (pid_t)syscall(SYS_gettid);
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
  while ((wave = next_wave(g)) != NULL) {
    const double t0 = now_seconds();
    const uint64_t chunks = pipeline_chunks(g, wave);
    for (request *r = wave; r != NULL; r = r->next) {
      r->status = RDT_SHM_OK;
      r->msg[0] = '\0';
      if (atomic_load(&g->aborted)) r->status = aborted_status(g, r, r->msg);
      else if (chunks) r->status = run_pipelined(g, r, chunks); /* alone in its wave: steps 1-3 */
      else step_in(g, r);
      if (chunks && r->status != RDT_SHM_OK && r->k) fail(g, r, r->status);
    }
    const uint64_t round = wave->k;
    for (request *r = wave; r != NULL && !chunks; r = r->next) {
      if (r->status != RDT_SHM_OK) continue;
      int st = atomic_load(&g->aborted) ? aborted_status(g, r, r->msg) : step_reduce(g, r);
      if (st != RDT_SHM_OK) fail(g, r, st);
    }
    while (wave != NULL) {
      request *r = wave;
      if (r->status == RDT_SHM_OK) {
        int st = chunks ? RDT_SHM_OK : atomic_load(&g->aborted) ? aborted_status(g, r, r->msg) : step_out(g, r);
        if (st != RDT_SHM_OK) {
          fail(g, r, st);
        } else {
          atomic_fetch_add(&g->moved_bytes, moved_by(g, r));
          atomic_fetch_add(&g->done_calls, 1);
        }
      }
      pthread_mutex_lock(&g->mu);
      wave = g->wave = r->next;
      pthread_mutex_unlock(&g->mu);
      if (wave == NULL) account(g, round, t0, now_seconds()); /* counted once its caller can look */
      r->done(r->arg, r->status, r->msg);
      pthread_mutex_lock(&g->mu);
      r->next = g->spare;
      g->spare = r;
      pthread_mutex_unlock(&g->mu);
    }
  }
  return NULL;
}

/* --------------------------------------------------------- create, release */
static void unmap_all(rdt_shm_group *g) {
  if (g->base != NULL)
    for (int i = 0; i < g->ranks; i++)
      if (g->base[i] != NULL && g->base[i] != MAP_FAILED) munmap(g->base[i], g->total);
}

static void free_group(rdt_shm_group *g) {
  unmap_all(g);
  while (g->spare != NULL) {
    request *r = g->spare;
    g->spare = r->next;
    free(r);
  }
  free(g->base);
  free(g->bucket_bytes);
  free(g->in_off);
  free(g->calls);
  free(g->in_wave);
  pthread_mutex_destroy(&g->mu);
  pthread_cond_destroy(&g->cv);
  free(g);
}

static int check_header(const rdt_shm_group *g, int r, uint64_t checksum, char *err, size_t errlen) {
  const unsigned char *h = g->base[r];
  uint64_t magic, total, sum;
  uint32_t version, rank, ranks, buckets;
  memcpy(&magic, h, 8);
  memcpy(&version, h + 8, 4);
  memcpy(&rank, h + 12, 4);
  memcpy(&ranks, h + 16, 4);
  memcpy(&buckets, h + 20, 4);
  memcpy(&total, h + 24, 8);
  memcpy(&sum, h + 32, 8);
  if (magic != RDT_SHM_MAGIC || version != RDT_SHM_VERSION) {
    say(err, errlen, "rank %d's segment is not an rdmatensor shm all-reduce segment of version %u", r,
        RDT_SHM_VERSION);
    return -1;
  }
  if (rank != (uint32_t)r || ranks != (uint32_t)g->ranks) {
    say(err, errlen, "the segment given as rank %d's belongs to rank %u of %u (this group: %d ranks)", r, rank,
        ranks, g->ranks);
    return -1;
  }
  if (buckets != g->buckets || total != g->total || sum != checksum) {
    say(err, errlen,
        "rank %d's segment is laid out for %u buckets in %llu bytes, this rank's layout %u buckets in %llu bytes "
        "(or the bucket sizes differ): every rank must give the same buckets",
        r, buckets, (unsigned long long)total, g->buckets, (unsigned long long)g->total);
    return -1;
  }
  return 0;
}

rdt_shm_group *rdt_shm_group_create(const int *fds, int rank, int ranks, uint32_t buckets,
                                    const uint64_t *bucket_bytes, double timeout_seconds, char *err,
                                    size_t errlen) {
  if (ranks < 1 || ranks > RDT_SHM_MAX_RANKS || rank < 0 || rank >= ranks) {
    say(err, errlen, "rank %d of %d ranks: give 0 <= rank < ranks <= %d", rank, ranks, RDT_SHM_MAX_RANKS);
    return NULL;
  }
  if (!(timeout_seconds > 0)) {
    say(err, errlen, "timeout %g s: give a positive number of seconds", timeout_seconds);
    return NULL;
  }
  uint64_t total = rdt_shm_segment_bytes(buckets, bucket_bytes);
  if (total == 0 || total > (uint64_t)SIZE_MAX) {
    say(err, errlen, "the buckets do not fit in one segment");
    return NULL;
  }
  rdt_shm_group *g = calloc(1, sizeof *g);
  if (g == NULL) {
    say(err, errlen, "out of memory");
    return NULL;
  }
  g->rank = rank;
  g->ranks = ranks;
  g->buckets = buckets;
  g->timeout = timeout_seconds;
  g->total = total;
  g->next_id = 1;
  atomic_init(&g->refs, 1);
  atomic_init(&g->done_calls, 0);
  atomic_init(&g->moved_bytes, 0);
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, NULL);
  g->bucket_bytes = calloc(buckets ? buckets : 1, sizeof(uint64_t));
  g->in_off = calloc(buckets ? buckets : 1, sizeof(uint64_t));
  g->calls = calloc(buckets ? buckets : 1, sizeof(uint64_t));
  g->in_wave = calloc(buckets ? buckets : 1, 1);
  g->base = calloc((size_t)ranks, sizeof(unsigned char *));
  if (!g->bucket_bytes || !g->in_off || !g->calls || !g->in_wave || !g->base) {
    say(err, errlen, "out of memory");
    free_group(g);
    return NULL;
  }
  uint64_t off = align64(OFF_BUCKETS + (uint64_t)BUCKET_STRIDE * buckets);
  for (uint32_t b = 0; b < buckets; b++) {
    g->bucket_bytes[b] = bucket_bytes[b];
    g->in_off[b] = off;
    off += 2 * align64(bucket_bytes[b]);
  }
  uint64_t checksum = layout_checksum(buckets, bucket_bytes);
  for (int r = 0; r < ranks; r++) {
    struct stat st;
    if (fstat(fds[r], &st) != 0) {
      say(err, errlen, "rank %d's segment (fd %d): %s", r, fds[r], strerror(errno));
      free_group(g);
      return NULL;
    }
    int seals = fcntl(fds[r], F_GET_SEALS);
    if ((uint64_t)st.st_size < total || seals < 0 || !(seals & F_SEAL_SHRINK)) {
      say(err, errlen, "rank %d's segment (fd %d) is not a memfd of at least %llu bytes sealed against shrinking", r,
          fds[r], (unsigned long long)total);
      free_group(g);
      return NULL;
    }
    int prot = r == rank ? PROT_READ | PROT_WRITE : PROT_READ;
    g->base[r] = mmap(NULL, (size_t)total, prot, MAP_SHARED, fds[r], 0);
    if (g->base[r] == MAP_FAILED) {
      say(err, errlen, "mapping rank %d's segment: %s", r, strerror(errno));
      g->base[r] = NULL;
      free_group(g);
      return NULL;
    }
    if (check_header(g, r, checksum, err, errlen) != 0) {
      free_group(g);
      return NULL;
    }
  }
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old); /* the executor takes no signal */
  int rc = pthread_create(&g->thread, NULL, executor, g);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) {
    say(err, errlen, "starting the executor thread: %s", strerror(rc));
    free_group(g);
    return NULL;
  }
  g->started = 1;
  pthread_mutex_lock(&g->mu); /* its id, for rdt_shm_group_set_nice */
  while (g->tid == 0) pthread_cond_wait(&g->cv, &g->mu);
  pthread_mutex_unlock(&g->mu);
  return g;
}

int rdt_shm_group_set_nice(rdt_shm_group *g, int nice) {
  return setpriority(PRIO_PROCESS, (id_t)g->tid, nice) == 0 ? 0 : errno;
}

void rdt_shm_group_retain(rdt_shm_group *g) { atomic_fetch_add(&g->refs, 1); }

void rdt_shm_group_release(rdt_shm_group *g) {
  if (atomic_fetch_sub(&g->refs, 1) != 1) return;
  rdt_shm_group_abort(g, RDT_SHM_CLOSED, "the group was closed");
  pthread_mutex_lock(&g->mu);
  g->closing = 1;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
  if (g->started) {
    if (pthread_equal(pthread_self(), g->thread)) {
      pthread_detach(g->thread); /* misuse (from a done callback): leak rather than deadlock */
      return;
    }
    pthread_join(g->thread, NULL);
  }
  free_group(g);
}

/* --------------------------------------------------------- submitting */
static int check_request(const rdt_shm_group *g, uint32_t bucket, const void *in, const void *out, uint64_t count,
                         int dtype, int op, const char *name, char *err, size_t errlen) {
  size_t esize = dtype_size(dtype);
  if (esize == 0) {
    say(err, errlen, "all-reduce of %s: dtype code %d is not one of float32, float64, int32, int64, float16", name,
        dtype);
    return -1;
  }
  if (op < RDT_SHM_SUM || op > RDT_SHM_PRODUCT) {
    say(err, errlen, "all-reduce of %s: op code %d is not one of sum, average, min, max, product", name, op);
    return -1;
  }
  if (bucket >= g->buckets) {
    say(err, errlen, "all-reduce of %s: bucket %u does not exist (the group has %u)", name, bucket, g->buckets);
    return -1;
  }
  if (count > g->bucket_bytes[bucket] / esize) {
    say(err, errlen, "all-reduce of %s: %llu elements of %s (%llu bytes) do not fit in bucket %u (%llu bytes)", name,
        (unsigned long long)count, dtype_name(dtype), (unsigned long long)(count * esize), bucket,
        (unsigned long long)g->bucket_bytes[bucket]);
    return -1;
  }
  if (count && (in == NULL || out == NULL)) {
    say(err, errlen, "all-reduce of %s: no buffer", name);
    return -1;
  }
  return 0;
}

/* The parts of one request (NULL: each request is its in, out and count). */
struct parts {
  int n;
  const void *const *ins;
  void *const *outs;
  const uint64_t *counts;
};

static int submit(rdt_shm_group *g, int m, const uint32_t *buckets, const void *const *ins, void *const *outs,
                  const uint64_t *counts, const int *dtypes, int op, double scale, const char *const *labels,
                  rdt_shm_done_fn done, void *const *args, uint64_t *ids, const struct parts *parts, char *err,
                  size_t errlen) {
  for (int i = 0; i < m; i++) {
    const char *name = labels && labels[i] && labels[i][0] ? labels[i] : "a tensor";
    if (check_request(g, buckets[i], ins[i], outs[i], counts[i], dtypes[i], op, name, err, errlen) != 0) return -1;
  }
  if (done == NULL) {
    say(err, errlen, "all-reduce: no completion callback");
    return -1;
  }
  /* the requests, from the spares or new, linked together before the queue sees them */
  request *first = NULL, *last = NULL;
  pthread_mutex_lock(&g->mu);
  for (int i = 0; i < m && g->spare != NULL; i++) {
    request *r = g->spare;
    g->spare = r->next;
    r->next = first;
    first = r;
  }
  pthread_mutex_unlock(&g->mu);
  request *pool = first;
  first = NULL;
  for (int i = 0; i < m; i++) {
    request *r = pool;
    if (r != NULL) {
      pool = r->next;
    } else if ((r = malloc(sizeof *r)) == NULL) {
      for (request *q = first; q != NULL;) {
        request *next = q->next;
        free(q);
        q = next;
      }
      for (request *q = pool; q != NULL;) {
        request *next = q->next;
        free(q);
        q = next;
      }
      say(err, errlen, "out of memory");
      return -1;
    }
    const char *name = labels && labels[i] && labels[i][0] ? labels[i] : "a tensor";
    r->next = NULL;
    r->k = 0;
    r->status = RDT_SHM_OK;
    r->msg[0] = '\0';
    r->bucket = buckets[i];
    r->in = ins[i];
    r->out = outs[i];
    r->count = counts[i];
    if (parts != NULL) {
      r->parts = parts->n;
      r->ins = parts->ins;
      r->outs = parts->outs;
      r->counts = parts->counts;
    } else {
      r->parts = 1;
      r->ins = &r->in;
      r->outs = &r->out;
      r->counts = &r->count;
    }
    r->dtype = dtypes[i];
    r->op = op;
    r->scale = scale;
    size_t len = strnlen(name, sizeof r->label - 1);
    memcpy(r->label, name, len);
    r->label[len] = '\0';
    r->done = done;
    r->arg = args ? args[i] : NULL;
    if (last) last->next = r;
    else first = r;
    last = r;
  }
  if (first == NULL) return 0;
  const double at = now_seconds();
  pthread_mutex_lock(&g->mu);
  int i = 0;
  for (request *r = first; r != NULL; r = r->next, i++) {
    r->id = g->next_id++;
    if (ids) ids[i] = r->id;
    if (r->bucket == g->buckets - 1) g->last_submit_at[g->last_submits++ % LAST_SUBMITS] = at;
  }
  if (g->tail) g->tail->next = first;
  else g->head = first;
  g->tail = last;
  atomic_fetch_add_explicit(&g->queued, m, memory_order_release);
  pthread_cond_signal(&g->cv);
  pthread_mutex_unlock(&g->mu);
  return 0;
}

int rdt_shm_group_submit_many(rdt_shm_group *g, int m, const uint32_t *buckets, const void *const *ins,
                              void *const *outs, const uint64_t *counts, const int *dtypes, int op, double scale,
                              const char *const *labels, rdt_shm_done_fn done, void *const *args, uint64_t *ids,
                              char *err, size_t errlen) {
  return submit(g, m, buckets, ins, outs, counts, dtypes, op, scale, labels, done, args, ids, NULL, err, errlen);
}

uint64_t rdt_shm_group_submit(rdt_shm_group *g, uint32_t bucket, const void *in, void *out, uint64_t count,
                              int dtype, int op, double scale, const char *label, rdt_shm_done_fn done,
                              void *arg, char *err, size_t errlen) {
  return rdt_shm_group_submit_parts(g, bucket, 1, &in, &out, &count, dtype, op, scale, label, done, arg, err,
                                    errlen);
}

uint64_t rdt_shm_group_submit_parts(rdt_shm_group *g, uint32_t bucket, int parts, const void *const *ins,
                                    void *const *outs, const uint64_t *counts, int dtype, int op, double scale,
                                    const char *label, rdt_shm_done_fn done, void *arg, char *err, size_t errlen) {
  const char *name = label && label[0] ? label : "a tensor";
  if (parts < 1 || ins == NULL || outs == NULL || counts == NULL) {
    say(err, errlen, "all-reduce of %s: %d parts", name, parts);
    return 0;
  }
  uint64_t count = 0;
  for (int i = 0; i < parts; i++) {
    if (counts[i] > UINT64_MAX - count) {
      say(err, errlen, "all-reduce of %s: its parts' elements overflow 64 bits", name);
      return 0;
    }
    count += counts[i];
    if (counts[i] && (ins[i] == NULL || outs[i] == NULL)) {
      say(err, errlen, "all-reduce of %s: part %d has no buffer", name, i);
      return 0;
    }
  }
  /* the first part holding elements stands for in and out in the request's checks */
  int first = 0;
  while (first < parts - 1 && counts[first] == 0) first++;
  const void *in = ins[first];
  void *out = outs[first];
  const struct parts p = {parts, ins, outs, counts};
  uint64_t id = 0;
  void *args[1] = {arg};
  if (submit(g, 1, &bucket, &in, &out, &count, &dtype, op, scale, &label, done, args, &id, parts == 1 ? NULL : &p,
             err, errlen) != 0)
    return 0;
  return id;
}

int rdt_shm_group_cancel(rdt_shm_group *g, uint64_t id, const char *why) {
  int pending = 0;
  pthread_mutex_lock(&g->mu);
  for (request *r = g->wave; r && !pending; r = r->next)
    if (r->id == id) pending = 1;
  for (request *r = g->head; r && !pending; r = r->next)
    if (r->id == id) pending = 1;
  pthread_mutex_unlock(&g->mu);
  if (pending) rdt_shm_group_abort(g, RDT_SHM_CANCELLED, why ? why : "cancelled");
  return pending;
}

struct sync_wait {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int left, status; /* status: the first failure's */
  char *msg;
  size_t msglen;
};

struct sync_ticket {
  struct sync_wait *w;
  int *status; /* where this request's status goes, or NULL */
};

static void sync_done(void *arg, int status, const char *message) {
  struct sync_ticket *t = arg;
  struct sync_wait *w = t->w;
  if (t->status) *t->status = status;
  pthread_mutex_lock(&w->mu);
  if (status != RDT_SHM_OK && w->status == RDT_SHM_OK) {
    w->status = status;
    say(w->msg, w->msglen, "%s", message);
  }
  if (--w->left == 0) pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

int rdt_shm_group_allreduce_many(rdt_shm_group *g, int m, const uint32_t *buckets, const void *const *ins,
                                 void *const *outs, const uint64_t *counts, const int *dtypes, int op, double scale,
                                 const char *const *labels, int *statuses, char *err, size_t errlen) {
  struct sync_wait w = {.left = 0, .status = RDT_SHM_OK, .msg = err, .msglen = errlen};
  struct sync_ticket *tickets = calloc(m > 0 ? (size_t)m : 1, sizeof *tickets);
  if (tickets == NULL) {
    say(err, errlen, "out of memory");
    return RDT_SHM_SYSTEM;
  }
  pthread_mutex_init(&w.mu, NULL);
  pthread_cond_init(&w.cv, NULL);
  if (err && errlen) err[0] = '\0';
  for (int i = 0; i < m; i++) {
    const char *name = labels && labels[i] && labels[i][0] ? labels[i] : "a tensor";
    if (check_request(g, buckets[i], ins[i], outs[i], counts[i], dtypes[i], op, name, err, errlen) != 0) {
      for (int j = 0; statuses && j < m; j++) statuses[j] = j == i ? RDT_SHM_INVALID : -1;
      pthread_mutex_destroy(&w.mu);
      pthread_cond_destroy(&w.cv);
      free(tickets);
      return RDT_SHM_INVALID; /* nothing was queued */
    }
  }
  void **args = calloc(m > 0 ? (size_t)m : 1, sizeof *args);
  if (args == NULL) {
    say(err, errlen, "out of memory");
    pthread_mutex_destroy(&w.mu);
    pthread_cond_destroy(&w.cv);
    free(tickets);
    return RDT_SHM_SYSTEM;
  }
  for (int i = 0; i < m; i++) {
    tickets[i].w = &w;
    tickets[i].status = statuses ? &statuses[i] : NULL;
    args[i] = &tickets[i];
  }
  w.left = m;
  int refused = RDT_SHM_OK;
  if (m > 0 && rdt_shm_group_submit_many(g, m, buckets, ins, outs, counts, dtypes, op, scale, labels, sync_done,
                                         args, NULL, err, errlen) != 0) {
    refused = RDT_SHM_SYSTEM; /* the arguments were checked: out of memory, nothing queued */
    w.left = 0;
  }
  free(args);
  pthread_mutex_lock(&w.mu);
  while (w.left > 0) pthread_cond_wait(&w.cv, &w.mu);
  pthread_mutex_unlock(&w.mu);
  pthread_mutex_destroy(&w.mu);
  pthread_cond_destroy(&w.cv);
  free(tickets);
  return refused != RDT_SHM_OK ? refused : w.status;
}

int rdt_shm_group_allreduce(rdt_shm_group *g, uint32_t bucket, const void *in, void *out, uint64_t count,
                            int dtype, int op, double scale, const char *label, char *err, size_t errlen) {
  return rdt_shm_group_allreduce_parts(g, bucket, 1, &in, &out, &count, dtype, op, scale, label, err, errlen);
}

int rdt_shm_group_allreduce_parts(rdt_shm_group *g, uint32_t bucket, int parts, const void *const *ins,
                                  void *const *outs, const uint64_t *counts, int dtype, int op, double scale,
                                  const char *label, char *err, size_t errlen) {
  struct sync_wait w = {.left = 1, .status = RDT_SHM_OK, .msg = err, .msglen = errlen};
  struct sync_ticket t = {&w, NULL};
  pthread_mutex_init(&w.mu, NULL);
  pthread_cond_init(&w.cv, NULL);
  if (err && errlen) err[0] = '\0';
  if (rdt_shm_group_submit_parts(g, bucket, parts, ins, outs, counts, dtype, op, scale, label, sync_done, &t, err,
                                 errlen) == 0) {
    pthread_mutex_destroy(&w.mu);
    pthread_cond_destroy(&w.cv);
    return RDT_SHM_INVALID;
  }
  pthread_mutex_lock(&w.mu);
  while (w.left > 0) pthread_cond_wait(&w.cv, &w.mu);
  pthread_mutex_unlock(&w.mu);
  pthread_mutex_destroy(&w.mu);
  pthread_cond_destroy(&w.cv);
  return w.status;
}
