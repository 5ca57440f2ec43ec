/* Spike: an asynchronous kernel through TensorFlow's C kernel API only.
 * Op RdtAsync(x: float) -> y = 2 * x, completed from a pthread after delay_ms.
 * Attrs: fail (complete with FAILED_PRECONDITION), barrier (wait until that many
 * RdtAsync ops are pending at once, or fail with DEADLINE_EXCEEDED after timeout_ms),
 * external (output wraps malloc memory through TF_NewTensor + deallocator: 1 aligned, 2 misaligned),
 * complete (0: from a detached pthread after ComputeAsync returned, the asynchronous case;
 *           1: inline before returning; 2: from a pthread joined before returning). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tensorflow/c/kernels.h"
/* ops.h declares these as bare `struct X;` (C++ style): plain C needs the typedefs. */
typedef struct TF_DimensionHandle TF_DimensionHandle;
typedef struct TF_OpDefinitionBuilder TF_OpDefinitionBuilder;
typedef struct TF_ShapeHandle TF_ShapeHandle;
typedef struct TF_ShapeInferenceContext TF_ShapeInferenceContext;
#include "tensorflow/c/ops.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/c/tf_tensor.h"

static atomic_long g_deallocs, g_pending, g_max_pending, g_done_calls;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static long g_arrived;

long rdt_spike_deallocs(void) { return atomic_load(&g_deallocs); }
long rdt_spike_max_pending(void) { return atomic_load(&g_max_pending); }
long rdt_spike_done_calls(void) { return atomic_load(&g_done_calls); }
void rdt_spike_reset(void) {
  atomic_store(&g_deallocs, 0);
  atomic_store(&g_max_pending, 0);
  atomic_store(&g_done_calls, 0);
  pthread_mutex_lock(&g_mu);
  g_arrived = 0;
  pthread_mutex_unlock(&g_mu);
}

typedef struct {
  int64_t delay_ms, barrier, timeout_ms, external, complete;
  unsigned char fail;
} Kernel;

typedef struct {
  Kernel* k;
  TF_OpKernelContext* ctx;
  TF_AsyncOpKernelDoneCallback* done;
} Job;

static void shape_same(TF_ShapeInferenceContext* ctx, TF_Status* st) {
  TF_ShapeHandle* h = TF_NewShapeHandle();
  TF_ShapeInferenceContextGetInput(ctx, 0, h, st);
  if (TF_GetCode(st) == TF_OK) TF_ShapeInferenceContextSetOutput(ctx, 0, h, st);
  TF_DeleteShapeHandle(h);
}

static void* k_create(TF_OpKernelConstruction* c) {
  Kernel* k = calloc(1, sizeof *k);
  TF_Status* st = TF_NewStatus();
  TF_OpKernelConstruction_GetAttrInt64(c, "delay_ms", &k->delay_ms, st);
  TF_OpKernelConstruction_GetAttrInt64(c, "barrier", &k->barrier, st);
  TF_OpKernelConstruction_GetAttrInt64(c, "timeout_ms", &k->timeout_ms, st);
  TF_OpKernelConstruction_GetAttrInt64(c, "external", &k->external, st);
  TF_OpKernelConstruction_GetAttrInt64(c, "complete", &k->complete, st);
  TF_OpKernelConstruction_GetAttrBool(c, "fail", &k->fail, st);
  if (TF_GetCode(st) != TF_OK) TF_OpKernelConstruction_Failure(c, st);
  TF_DeleteStatus(st);
  return k;
}

static void k_delete(void* k) { free(k); }

static void dealloc(void* data, size_t len, void* base) {
  (void)len;
  (void)data;
  free(base);
  atomic_fetch_add(&g_deallocs, 1);
}

static void sleep_ms(int64_t ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

/* 0 when `barrier` ops have arrived, -1 on timeout. */
static int wait_barrier(int64_t n, int64_t timeout_ms) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += timeout_ms / 1000;
  dl.tv_nsec += (timeout_ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) { dl.tv_sec++; dl.tv_nsec -= 1000000000L; }
  int rc = 0;
  pthread_mutex_lock(&g_mu);
  g_arrived++;
  pthread_cond_broadcast(&g_cv);
  while (g_arrived < n && rc == 0) rc = pthread_cond_timedwait(&g_cv, &g_mu, &dl);
  int ok = g_arrived >= n;
  pthread_mutex_unlock(&g_mu);
  return ok ? 0 : -1;
}

static void* worker(void* arg) {
  Job* j = arg;
  Kernel* k = j->k;
  TF_Status* st = TF_NewStatus();
  if (k->delay_ms) sleep_ms(k->delay_ms);
  if (k->barrier && wait_barrier(k->barrier, k->timeout_ms) != 0) {
    TF_SetStatus(st, TF_DEADLINE_EXCEEDED, "rdt spike: barrier timed out");
    TF_OpKernelContext_Failure(j->ctx, st);
    goto out;
  }
  if (k->fail) {
    TF_SetStatus(st, TF_FAILED_PRECONDITION, "rdt spike: asked to fail");
    TF_OpKernelContext_Failure(j->ctx, st);
    goto out;
  }
  TF_Tensor* in = NULL;
  TF_GetInput(j->ctx, 0, &in, st);
  if (TF_GetCode(st) != TF_OK) { TF_OpKernelContext_Failure(j->ctx, st); goto out; }
  int nd = TF_NumDims(in);
  int64_t dims[8];
  for (int i = 0; i < nd; i++) dims[i] = TF_Dim(in, i);
  size_t len = TF_TensorByteSize(in);
  const float* x = TF_TensorData(in);
  TF_Tensor* out;
  if (k->external) {
    /* external == 2: deliberately misaligned, to see what TF_NewTensor does with it. */
    size_t align = TF_TensorDefaultAlignment();
    char* base = aligned_alloc(align, len + align);
    float* y = (float*)(base + (k->external == 2 ? 4 : 0));
    for (size_t i = 0; i < len / sizeof(float); i++) y[i] = 2 * x[i];
    out = TF_NewTensor(TF_FLOAT, dims, nd, y, len, dealloc, base);
    TF_SetOutput(j->ctx, 0, out, st);
    TF_DeleteTensor(out); /* TF's output now holds the buffer's reference */
  } else {
    out = TF_AllocateOutput(j->ctx, 0, TF_FLOAT, dims, nd, len, st);
    if (TF_GetCode(st) == TF_OK) {
      float* y = TF_TensorData(out);
      for (size_t i = 0; i < len / sizeof(float); i++) y[i] = 2 * x[i];
    }
    TF_DeleteTensor(out);
  }
  TF_DeleteTensor(in);
  if (TF_GetCode(st) != TF_OK) TF_OpKernelContext_Failure(j->ctx, st);
out:
  TF_DeleteStatus(st);
  atomic_fetch_sub(&g_pending, 1);
  atomic_fetch_add(&g_done_calls, 1);
  TF_RunAsyncOpKernelDoneCallback(j->done);
  free(j);
  return NULL;
}

static void k_compute_async(void* kp, TF_OpKernelContext* ctx, TF_AsyncOpKernelDoneCallback* done) {
  long p = atomic_fetch_add(&g_pending, 1) + 1;
  long m = atomic_load(&g_max_pending);
  while (p > m && !atomic_compare_exchange_weak(&g_max_pending, &m, p)) {}
  Job* j = malloc(sizeof *j);
  j->k = kp;
  j->ctx = ctx;
  j->done = done;
  Kernel* k = kp;
  if (k->complete == 1) {
    worker(j);
    return;
  }
  pthread_t t;
  pthread_attr_t a;
  pthread_attr_init(&a);
  if (k->complete == 0) pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  pthread_create(&t, &a, worker, j);
  pthread_attr_destroy(&a);
  if (k->complete == 2) pthread_join(t, NULL);
}

__attribute__((constructor)) static void register_all(void) {
  TF_Status* st = TF_NewStatus();
  TF_OpDefinitionBuilder* b = TF_NewOpDefinitionBuilder("RdtAsync");
  TF_OpDefinitionBuilderAddInput(b, "x: float");
  TF_OpDefinitionBuilderAddOutput(b, "y: float");
  TF_OpDefinitionBuilderAddAttr(b, "delay_ms: int = 0");
  TF_OpDefinitionBuilderAddAttr(b, "barrier: int = 0");
  TF_OpDefinitionBuilderAddAttr(b, "timeout_ms: int = 2000");
  TF_OpDefinitionBuilderAddAttr(b, "external: int = 0");
  TF_OpDefinitionBuilderAddAttr(b, "complete: int = 0");
  TF_OpDefinitionBuilderAddAttr(b, "fail: bool = false");
  /* Stateless: tf.function chains stateful ops by automatic control dependencies. */
  TF_OpDefinitionBuilderSetShapeInferenceFunction(b, shape_same);
  TF_RegisterOpDefinition(b, st);
  if (TF_GetCode(st) != TF_OK) fprintf(stderr, "op: %s\n", TF_Message(st));
  TF_KernelBuilder* kb = TF_NewAsyncKernelBuilder("RdtAsync", "CPU", k_create, k_compute_async, k_delete);
  TF_RegisterKernelBuilder("RdtAsyncCPU", kb, st);
  if (TF_GetCode(st) != TF_OK) fprintf(stderr, "kernel: %s\n", TF_Message(st));
  TF_DeleteStatus(st);
}
