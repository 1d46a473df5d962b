// A CUDA timeline without Nsight Systems (absent on the lent H100s): a library the CUDA
// driver loads at initialisation when CUDA_INJECTION64_PATH names it, which asks CUPTI's
// activity API for every kernel (also inside CUDA graphs), copy, memset, synchronisation
// and runtime/driver API call, with start and end on one clock, and writes them as text
// lines to $CUPTI_TRACE_OUT (default /tmp/cupti-PID.txt) when the process exits.
// scripts/bench/cupti_gaps.py reads the files: where the GPU idles between kernels, and
// what the host did meanwhile. Built by scripts/cuda/cupti_pack.sh.
//
// Lines (times in ns on CUPTI's clock):
//   K start end graph_id graph_node_id stream correlation name    a kernel
//   A start end R|D cbid correlation thread                        a runtime / driver call
//   N R|D cbid name                                                a call id's name (once)
//   C start end kind bytes stream correlation                      a copy
//   M start end bytes stream correlation                           a memset
//   S start end type stream correlation                            a synchronisation
// CUPTI_TRACE_API=0 leaves the API calls out (the other records stay).
#include <cupti.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BUF_BYTES (16u << 20)

static FILE* out;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
// Call ids whose name line is written (runtime and driver ids stay below this).
#define MAX_CBID 4096
static unsigned char named[2][MAX_CBID];

static void CUPTIAPI requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = aligned_alloc(8, BUF_BYTES);
  *size = *buffer ? BUF_BYTES : 0;
  *max_records = 0;
}

static void name_once(int driver, CUpti_CallbackId cbid) {
  if (cbid >= MAX_CBID || named[driver][cbid]) return;
  named[driver][cbid] = 1;
  const char* name = NULL;
  cuptiGetCallbackName(driver ? CUPTI_CB_DOMAIN_DRIVER_API : CUPTI_CB_DOMAIN_RUNTIME_API, cbid, &name);
  fprintf(out, "N %c %u %s\n", driver ? 'D' : 'R', cbid, name ? name : "?");
}

static void write_record(CUpti_Activity* r) {
  switch (r->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      CUpti_ActivityKernel10* k = (CUpti_ActivityKernel10*)r;
      fprintf(out, "K %llu %llu %u %llu %u %u %s\n", (unsigned long long)k->start,
              (unsigned long long)k->end, k->graphId, (unsigned long long)k->graphNodeId, k->streamId,
              k->correlationId, k->name ? k->name : "?");
      break;
    }
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER: {
      CUpti_ActivityAPI* a = (CUpti_ActivityAPI*)r;
      int driver = r->kind == CUPTI_ACTIVITY_KIND_DRIVER;
      name_once(driver, a->cbid);
      fprintf(out, "A %llu %llu %c %u %u %u\n", (unsigned long long)a->start, (unsigned long long)a->end,
              driver ? 'D' : 'R', a->cbid, a->correlationId, a->threadId);
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      CUpti_ActivityMemcpy6* c = (CUpti_ActivityMemcpy6*)r;
      fprintf(out, "C %llu %llu %u %llu %u %u\n", (unsigned long long)c->start, (unsigned long long)c->end,
              c->copyKind, (unsigned long long)c->bytes, c->streamId, c->correlationId);
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      CUpti_ActivityMemset4* m = (CUpti_ActivityMemset4*)r;
      fprintf(out, "M %llu %llu %llu %u %u\n", (unsigned long long)m->start, (unsigned long long)m->end,
              (unsigned long long)m->bytes, m->streamId, m->correlationId);
      break;
    }
    case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION: {
      CUpti_ActivitySynchronization2* s = (CUpti_ActivitySynchronization2*)r;
      fprintf(out, "S %llu %llu %u %u %u\n", (unsigned long long)s->start, (unsigned long long)s->end,
              (unsigned)s->type, s->streamId, s->correlationId);
      break;
    }
    default:
      break;
  }
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t size, size_t valid) {
  (void)ctx;
  (void)stream;
  (void)size;
  CUpti_Activity* r = NULL;
  pthread_mutex_lock(&lock);
  while (out && cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) write_record(r);
  size_t dropped = 0;
  if (out && cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped)
    fprintf(out, "# dropped %zu\n", dropped);
  pthread_mutex_unlock(&lock);
  free(buffer);
}

static void at_exit(void) {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  pthread_mutex_lock(&lock);
  if (out) {
    fclose(out);
    out = NULL;
  }
  pthread_mutex_unlock(&lock);
}

static int enable(CUpti_ActivityKind kind, const char* what) {
  CUptiResult r = cuptiActivityEnable(kind);
  if (r != CUPTI_SUCCESS) {
    const char* msg = NULL;
    cuptiGetResultString(r, &msg);
    fprintf(stderr, "cupti_trace: enabling %s failed: %s\n", what, msg ? msg : "?");
    return 0;
  }
  return 1;
}

// Called by the CUDA driver once, when it initialises (CUDA_INJECTION64_PATH).
int InitializeInjection(void) {
  const char* path = getenv("CUPTI_TRACE_OUT");
  char fallback[64];
  if (!path || !*path) {
    snprintf(fallback, sizeof fallback, "/tmp/cupti-%d.txt", (int)getpid());
    path = fallback;
  }
  out = fopen(path, "w");
  if (!out) {
    fprintf(stderr, "cupti_trace: cannot write %s\n", path);
    return 0;
  }
  fprintf(out, "# cupti_trace pid %d\n", (int)getpid());
  if (cuptiActivityRegisterCallbacks(requested, completed) != CUPTI_SUCCESS) {
    fprintf(stderr, "cupti_trace: cannot register CUPTI buffers\n");
    return 0;
  }
  enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, "kernels");
  enable(CUPTI_ACTIVITY_KIND_MEMCPY, "copies");
  enable(CUPTI_ACTIVITY_KIND_MEMSET, "memsets");
  enable(CUPTI_ACTIVITY_KIND_SYNCHRONIZATION, "synchronisations");
  const char* api = getenv("CUPTI_TRACE_API");
  if (!api || strcmp(api, "0") != 0) {
    enable(CUPTI_ACTIVITY_KIND_RUNTIME, "runtime calls");
    enable(CUPTI_ACTIVITY_KIND_DRIVER, "driver calls");
  }
  atexit(at_exit);
  fprintf(stderr, "cupti_trace: writing %s\n", path);
  return 1;
}
