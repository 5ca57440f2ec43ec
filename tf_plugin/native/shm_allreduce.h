/* The all-reduce of ranks on one host over shared memory: the compiled executor.
 *
 * Plain C11, framework-free (no Python, no TensorFlow). tf_plugin/native/shm_twin.py
 * is its Python twin: both speak exactly the protocol below, so a C rank and a
 * Python rank can run in one group.
 *
 * Each rank owns one memfd segment that only it writes; its peers map it
 * read-only. Layout (every offset a multiple of 64, numbers little-endian):
 *
 *   0      header: magic u64, version u32, rank u32, ranks u32, buckets u32,
 *                  total bytes u64, layout checksum u64 (FNV-1a of the buckets' sizes)
 *   64     state u32: 0 while live, else the status this rank aborted with
 *   128    sleeping u32: 1 while this rank's executor sleeps in a futex wait
 *   192 + 128 b        bucket b's input line: in_seq u64, count u64, dtype u32, op u32, scale f64,
 *                      in_progress u64 (at + 32)
 *   192 + 128 b + 64   bucket b's output line: out_seq u64, out_progress u64
 *   data = align64(192 + 128 buckets), then per bucket its `in` region and its
 *   `out` region, each align64(the bucket's bytes).
 *
 * Call k (1, 2, ...) of bucket b on rank r of n (its elements cut into n nearly
 * equal contiguous slices, the first count % n one element longer):
 *   1. copy the input into my `in`, write the descriptor, publish in_seq = k;
 *   2. wait for every peer's in_seq >= k, check its descriptor against mine,
 *      reduce slice r over every rank's `in` (in rank order) into my `out`,
 *      scale it, publish out_seq = k;
 *   3. wait for every peer's out_seq >= k, copy slice j of rank j's `out` into
 *      the output, for every j.
 * After step 1 a rank also publishes in_progress = (k << 24) | 0xFFFFFF, after
 * step 2 out_progress likewise. A call whose slices exceed a chunk
 * (RDT_SHM_PIPELINE_BYTES) runs the three steps chunk by chunk instead, chunk j
 * of every slice a stage apart (copy in j, reduce j - 1, copy out j - 2),
 * publishing in_progress and out_progress = (k << 24) | (chunks done) after
 * each, and in_seq and out_seq = k once the step is done for every chunk; its
 * waits are on the progress words. The twin runs it the same way.
 * See shm_allreduce.c for why regions are safe to reuse at call k + 1.
 */
#ifndef RDT_SHM_ALLREDUCE_H
#define RDT_SHM_ALLREDUCE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RDT_SHM_MAGIC 0x31524448534d4452ULL /* "RDMSHDR1" */
#define RDT_SHM_VERSION 2u
/* A chunk of a pipelined call's slice (segment.py's PIPELINE_BYTES): every rank of a
 * group must use the same (0: no call pipelined). */
#ifndef RDT_SHM_PIPELINE_BYTES
#define RDT_SHM_PIPELINE_BYTES (256u * 1024u)
#endif
#define RDT_SHM_MAX_RANKS 1024
#define RDT_SHM_MESSAGE 320 /* bytes of an error message, with its NUL */

enum rdt_shm_dtype {
  RDT_SHM_FLOAT32 = 1,
  RDT_SHM_FLOAT64 = 2,
  RDT_SHM_INT32 = 3,
  RDT_SHM_INT64 = 4,
  RDT_SHM_FLOAT16 = 5,
};

/* AVERAGE is SUM whose scale is divided by the number of ranks (in double). */
enum rdt_shm_op {
  RDT_SHM_SUM = 1,
  RDT_SHM_AVERAGE = 2,
  RDT_SHM_MIN = 3,
  RDT_SHM_MAX = 4,
  RDT_SHM_PRODUCT = 5,
};

enum rdt_shm_status {
  RDT_SHM_OK = 0,
  RDT_SHM_INVALID = 1,      /* a bad argument: nothing was started */
  RDT_SHM_TIMEOUT = 2,      /* a peer did not arrive within the timeout */
  RDT_SHM_ABORTED = 3,      /* this rank aborted the group (or a failure broke it) */
  RDT_SHM_PEER_ABORTED = 4, /* a peer aborted its group */
  RDT_SHM_CANCELLED = 5,    /* the caller cancelled a pending all-reduce */
  RDT_SHM_MISMATCH = 6,     /* the ranks all-reduce different things on one bucket */
  RDT_SHM_CLOSED = 7,       /* the group was closed */
  RDT_SHM_SYSTEM = 8,       /* a system call failed */
};

typedef struct rdt_shm_group rdt_shm_group;

/* Called once per submitted request, from the group's executor thread (or from
 * rdt_shm_group_release's thread for requests still queued then), with no lock
 * held. `message` is empty on success and valid only during the call. */
typedef void (*rdt_shm_done_fn)(void *arg, int status, const char *message);

/* Bytes of a segment for these buckets; 0 if they do not fit in 64 bits. */
uint64_t rdt_shm_segment_bytes(uint32_t buckets, const uint64_t *bucket_bytes);

/* A group over `ranks` segments, fds[i] being rank i's (fds[rank] mine, mapped
 * read-write; the others read-only). Every segment must already hold its header
 * (tf_plugin/native/segment.py writes it), be sealed against shrinking, and be
 * laid out for these buckets. The fds may be closed once this returns. Starts
 * the executor thread. NULL on failure, with why in err. The group holds one
 * reference, the caller's. */
rdt_shm_group *rdt_shm_group_create(const int *fds, int rank, int ranks, uint32_t buckets,
                                    const uint64_t *bucket_bytes, double timeout_seconds, char *err,
                                    size_t errlen);

void rdt_shm_group_retain(rdt_shm_group *g);
/* Drops a reference; the last one aborts (RDT_SHM_CLOSED), joins the executor
 * thread, fails what is still queued and unmaps. Never from a done callback. */
void rdt_shm_group_release(rdt_shm_group *g);

/* Queues one all-reduce (FIFO: every rank must submit a group's requests in the
 * same order). `in` is read and `out` written by the executor thread until
 * `done` is called; they may be the same buffer. Returns a request id (> 0), or
 * 0 with nothing queued and why in err (RDT_SHM_INVALID: a bad bucket, dtype,
 * op or a count beyond the bucket). `label` names the tensor in messages. */
uint64_t rdt_shm_group_submit(rdt_shm_group *g, uint32_t bucket, const void *in, void *out, uint64_t count,
                              int dtype, int op, double scale, const char *label, rdt_shm_done_fn done,
                              void *arg, char *err, size_t errlen);

/* submit of one all-reduce whose input is `parts` buffers back to back, ins[i]
 * holding counts[i] elements, and whose output is as many, outs[i] of counts[i]
 * (a fusion bucket's members: no copy of them together first). The three arrays
 * are the caller's and are read until `done` is called; ins[i] and outs[i] may be
 * the same buffer. */
uint64_t rdt_shm_group_submit_parts(rdt_shm_group *g, uint32_t bucket, int parts, const void *const *ins,
                                    void *const *outs, const uint64_t *counts, int dtype, int op, double scale,
                                    const char *label, rdt_shm_done_fn done, void *arg, char *err, size_t errlen);

/* submit of m requests at once (one lock, one wake of the executor): 0, their ids
 * in ids (when not NULL); or -1, nothing queued, why in err (every request is
 * checked first). done(args[i], ...) is called once for each. */
int rdt_shm_group_submit_many(rdt_shm_group *g, int m, const uint32_t *buckets, const void *const *ins,
                              void *const *outs, const uint64_t *counts, const int *dtypes, int op, double scale,
                              const char *const *labels, rdt_shm_done_fn done, void *const *args, uint64_t *ids,
                              char *err, size_t errlen);

/* submit, then wait for it: its status, and the message in err. */
int rdt_shm_group_allreduce(rdt_shm_group *g, uint32_t bucket, const void *in, void *out, uint64_t count,
                            int dtype, int op, double scale, const char *label, char *err, size_t errlen);

/* submit_parts, then wait for it: its status, and the message in err. */
int rdt_shm_group_allreduce_parts(rdt_shm_group *g, uint32_t bucket, int parts, const void *const *ins,
                                  void *const *outs, const uint64_t *counts, int dtype, int op, double scale,
                                  const char *label, char *err, size_t errlen);

/* m all-reduces of one op and scale, all submitted, then all waited for (they
 * run in waves): the first failure's status (and message in err), statuses[i]
 * each one's when not NULL. A bad request (RDT_SHM_INVALID) refuses them all,
 * before any is queued. */
int rdt_shm_group_allreduce_many(rdt_shm_group *g, int m, const uint32_t *buckets, const void *const *ins,
                                 void *const *outs, const uint64_t *counts, const int *dtypes, int op, double scale,
                                 const char *const *labels, int *statuses, char *err, size_t errlen);

/* Breaks the group: every wait wakes, the running and queued requests and every
 * later one fail with `status` (RDT_SHM_ABORTED, RDT_SHM_CANCELLED, RDT_SHM_CLOSED...),
 * and the peers see this rank's segment as aborted. The first abort wins. */
void rdt_shm_group_abort(rdt_shm_group *g, int status, const char *why);

/* Cancels request `id` if still queued or running: a collective left half done
 * leaves the ranks out of step, so this aborts the group (RDT_SHM_CANCELLED).
 * Returns 1 if it was pending, 0 if already done (nothing happens then). */
int rdt_shm_group_cancel(rdt_shm_group *g, uint64_t id, const char *why);

/* 0 while live, else the status the group was aborted with. */
int rdt_shm_group_status(rdt_shm_group *g);

/* A peer that has begun a call of this group which this rank has not begun (nor
 * queued): its rank, with the bucket and the peer's call number there; -1 when
 * there is none. A caller that sees the same one for long knows the ranks called
 * different collectives (tf_plugin/core/checked_collectives.py). */
int rdt_shm_group_peer_ahead(rdt_shm_group *g, uint32_t *bucket, uint64_t *call);

/* The calls this rank completed in the group, and the bytes they moved across its
 * boundary each way (what it sent equals what it received: 2(n-1)/n of the data
 * for even slices, as a ring all-reduce's). */
void rdt_shm_group_counters(rdt_shm_group *g, uint64_t *calls, uint64_t *bytes);

/* Seconds the executor spent on this group's calls (a wave's, from taking it to its
 * last completion, counted before that completes), and of them the seconds before
 * the last bucket of the wave's round was submitted: with a step's buckets launched
 * as backprop makes them, the share that overlapped backprop. */
void rdt_shm_group_busy(rdt_shm_group *g, double *busy, double *overlapped);

/* Sets the executor thread's nice value (setpriority): 0, or the errno (EACCES
 * where raising a priority is not permitted). The thread shares its core with
 * the framework's threads making the gradients; below their nice it keeps pace
 * with backprop instead of queueing behind it, and a peer waits less on it. */
int rdt_shm_group_set_nice(rdt_shm_group *g, int nice);

#ifdef __cplusplus
}
#endif
#endif
