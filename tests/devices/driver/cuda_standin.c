/*
 * A stand-in for the CUDA driver library (libcuda), for tests only.
 *
 * It exports the driver entry points rustws calls (through cudarc, which loads `libcuda.so` at
 * run time) and serves them from host memory: "device" allocations are host allocations that the
 * stand-in tracks, so every copy, fill and free is checked against the live allocations, and
 * contexts, streams and events are small host objects. Every call that matters is written to a log
 * that tests read back to check the order of driver calls.
 *
 * Failure injection, through exported setters (`standin_*`):
 *   - device count (0 for "no device", and a bad ordinal above it);
 *   - a device memory limit (out of memory after N bytes);
 *   - frees that fail, and frees that take a while (to see that nothing waits for them);
 *   - cuCtxSetCurrent that fails, at once or after some calls succeed (a context the driver will
 *     not make current, or will not restore);
 *   - events that stay pending until completed by hand (work still running on a stream);
 *   - fills and device-to-device copies that fail (a device fault in the middle of a call).
 *
 * Destroyed streams are kept (marked dead, never freed), so a call that names one is refused and
 * logged as "DESTROYED STREAM" rather than reading freed memory.
 *
 * The test suites compile this file with the machine's C compiler; nothing in the package loads it.
 */

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_LAUNCH_FAILED = 719,
};

#define MAX_DEVICES 8
#define STANDIN_EXPORT __attribute__((visibility("default")))

struct standin_context {
    int magic;
    int device; /* -1: a context the stand-in made for "another library" */
    int retained;
};

struct standin_event {
    int magic;
    int complete;
    void *stream;
    struct standin_event *next;
};

struct standin_stream {
    int magic;
    unsigned int flags;
    struct standin_stream *next; /* every stream ever made, live or destroyed */
};

struct allocation {
    uintptr_t ptr;
    size_t len;
    int host; /* cuMemHostAlloc */
};

#define CTX_MAGIC 0x43545821
#define EVENT_MAGIC 0x45564e54
#define STREAM_MAGIC 0x5354524d
#define DEAD_STREAM_MAGIC 0x44454144

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialised;
static int device_count = 1;
static size_t memory_limit = (size_t)1 << 30;
static size_t device_bytes;
static size_t host_bytes;
static int failing_frees;
static long free_delay_us;
static int failing_set_current;
static int set_current_before_failing;
static int events_pending;
static int failing_copies;
static struct standin_context primary[MAX_DEVICES];
static struct standin_context foreign = {CTX_MAGIC, -1, 1};
static struct standin_event *events;
static struct standin_stream *streams;
static struct allocation *allocations;
static size_t n_allocations, cap_allocations;
static char *log_buf;
static size_t log_len, log_cap;
static __thread struct standin_context *current;

/* -- the call log ---------------------------------------------------------------------------- */
#define LOG_LIMIT ((size_t)1 << 22)

static void note(const char *fmt, ...) {
    char line[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof line) n = sizeof line - 1;
    pthread_mutex_lock(&lock);
    if (log_len + (size_t)n + 2 > LOG_LIMIT) log_len = 0; /* a long run: keep the recent calls */
    if (log_len + (size_t)n + 2 > log_cap) {
        size_t cap = log_cap ? log_cap * 2 : 4096;
        while (cap < log_len + (size_t)n + 2) cap *= 2;
        char *grown = realloc(log_buf, cap);
        if (!grown) {
            pthread_mutex_unlock(&lock);
            return;
        }
        log_buf = grown;
        log_cap = cap;
    }
    memcpy(log_buf + log_len, line, (size_t)n);
    log_len += (size_t)n;
    log_buf[log_len++] = '\n';
    log_buf[log_len] = 0;
    pthread_mutex_unlock(&lock);
}

/* -- allocations (the caller holds `lock`) ----------------------------------------------------- */
static int track(uintptr_t ptr, size_t len, int host) {
    if (n_allocations == cap_allocations) {
        size_t cap = cap_allocations ? cap_allocations * 2 : 64;
        struct allocation *grown = realloc(allocations, cap * sizeof *grown);
        if (!grown) return 0;
        allocations = grown;
        cap_allocations = cap;
    }
    allocations[n_allocations++] = (struct allocation){ptr, len, host};
    return 1;
}

static struct allocation *find_base(uintptr_t ptr, int host) {
    for (size_t i = 0; i < n_allocations; i++)
        if (allocations[i].ptr == ptr && allocations[i].host == host) return &allocations[i];
    return NULL;
}

/* Whether [ptr, ptr + len) lies inside one live device allocation. */
static int in_device_memory(CUdeviceptr ptr, size_t len) {
    int ok = 0;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < n_allocations && !ok; i++) {
        struct allocation *a = &allocations[i];
        ok = !a->host && ptr >= a->ptr && ptr + len >= ptr && ptr + len <= a->ptr + a->len;
    }
    pthread_mutex_unlock(&lock);
    return ok;
}

static int context_ok(void) {
    struct standin_context *c = current;
    return c && c->magic == CTX_MAGIC && c->retained > 0;
}

#define NEED_INIT()                                   \
    do {                                              \
        if (!initialised) return CUDA_ERROR_NOT_INITIALIZED; \
    } while (0)
#define NEED_CONTEXT(name)                                            \
    do {                                                              \
        NEED_INIT();                                                  \
        if (!context_ok()) {                                          \
            note("%s INVALID_CONTEXT", name);                         \
            return CUDA_ERROR_INVALID_CONTEXT;                        \
        }                                                             \
    } while (0)

static int ctx_id(struct standin_context *c) {
    if (!c) return -2;
    return c->device;
}

/* -- switches for tests ------------------------------------------------------------------------ */
STANDIN_EXPORT void standin_reset(void) {
    pthread_mutex_lock(&lock);
    device_count = 1;
    memory_limit = (size_t)1 << 30;
    failing_frees = 0;
    free_delay_us = 0;
    failing_set_current = 0;
    set_current_before_failing = 0;
    events_pending = 0;
    failing_copies = 0;
    for (struct standin_event *e = events; e; e = e->next) e->complete = 1;
    log_len = 0;
    if (log_buf) log_buf[0] = 0;
    pthread_mutex_unlock(&lock);
}

STANDIN_EXPORT void standin_set_device_count(int n) { device_count = n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : n; }
STANDIN_EXPORT void standin_set_memory_limit(size_t bytes) { memory_limit = bytes; }
STANDIN_EXPORT void standin_set_failing_frees(int n) { failing_frees = n; }
STANDIN_EXPORT void standin_set_free_delay_us(long us) { free_delay_us = us; }
/* The next `n` calls of cuCtxSetCurrent fail, after `after` more succeed. */
STANDIN_EXPORT void standin_set_failing_set_current(int n) { failing_set_current = n; }
STANDIN_EXPORT void standin_set_failing_set_current_after(int after, int n) {
    set_current_before_failing = after;
    failing_set_current = n;
}
STANDIN_EXPORT void standin_set_events_pending(int pending) { events_pending = pending; }
STANDIN_EXPORT void standin_set_failing_copies(int n) { failing_copies = n; }
STANDIN_EXPORT size_t standin_device_bytes(void) { return device_bytes; }
STANDIN_EXPORT size_t standin_host_bytes(void) { return host_bytes; }
/* A context of "another library" (PyTorch, CuPy) to make current around rustws calls. */
STANDIN_EXPORT void *standin_foreign_context(void) { return &foreign; }
/* The context current on the calling thread. */
STANDIN_EXPORT void *standin_current_context(void) { return current; }

/* Completes every recorded event (the work on every stream finished). */
STANDIN_EXPORT void standin_complete_events(void) {
    pthread_mutex_lock(&lock);
    for (struct standin_event *e = events; e; e = e->next) e->complete = 1;
    pthread_mutex_unlock(&lock);
    note("(all events complete)");
}

/* Copies the call log (NUL-terminated) into `out`; returns its full length. */
STANDIN_EXPORT size_t standin_log(char *out, size_t cap) {
    pthread_mutex_lock(&lock);
    size_t n = log_len;
    if (out && cap) {
        size_t k = n < cap - 1 ? n : cap - 1;
        if (k) memcpy(out, log_buf, k);
        out[k] = 0;
    }
    pthread_mutex_unlock(&lock);
    return n;
}

STANDIN_EXPORT void standin_clear_log(void) {
    pthread_mutex_lock(&lock);
    log_len = 0;
    if (log_buf) log_buf[0] = 0;
    pthread_mutex_unlock(&lock);
}

/* -- errors ------------------------------------------------------------------------------------ */
static const char *error_text(CUresult e) {
    switch (e) {
    case CUDA_SUCCESS: return "no error";
    case CUDA_ERROR_INVALID_VALUE: return "invalid argument";
    case CUDA_ERROR_OUT_OF_MEMORY: return "out of memory";
    case CUDA_ERROR_NOT_INITIALIZED: return "initialization error";
    case CUDA_ERROR_INVALID_DEVICE: return "invalid device ordinal";
    case CUDA_ERROR_INVALID_CONTEXT: return "invalid device context";
    case CUDA_ERROR_INVALID_HANDLE: return "invalid resource handle";
    case CUDA_ERROR_NOT_READY: return "device not ready";
    case CUDA_ERROR_LAUNCH_FAILED: return "unspecified launch failure";
    default: return NULL;
    }
}

STANDIN_EXPORT CUresult cuGetErrorString(CUresult e, const char **out) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    *out = error_text(e);
    return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

STANDIN_EXPORT CUresult cuGetErrorName(CUresult e, const char **out) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    switch (e) {
    case CUDA_SUCCESS: *out = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *out = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *out = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *out = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_INVALID_DEVICE: *out = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *out = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_INVALID_HANDLE: *out = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_NOT_READY: *out = "CUDA_ERROR_NOT_READY"; break;
    case CUDA_ERROR_LAUNCH_FAILED: *out = "CUDA_ERROR_LAUNCH_FAILED"; break;
    default: *out = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* -- initialisation and devices ---------------------------------------------------------------- */
STANDIN_EXPORT CUresult cuInit(unsigned int flags) {
    (void)flags;
    initialised = 1;
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = 12080;
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuDeviceGetCount(int *count) {
    NEED_INIT();
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = device_count;
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    NEED_INIT();
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= device_count) {
        note("cuDeviceGet %d INVALID_DEVICE", ordinal);
        return CUDA_ERROR_INVALID_DEVICE;
    }
    *device = ordinal;
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice device) {
    NEED_INIT();
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "rustws CUDA driver stand-in %d", device);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice device) {
    NEED_INIT();
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = memory_limit;
    return CUDA_SUCCESS;
}

/* -- contexts ---------------------------------------------------------------------------------- */
STANDIN_EXPORT CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice device) {
    NEED_INIT();
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    primary[device].magic = CTX_MAGIC;
    primary[device].device = device;
    primary[device].retained++;
    pthread_mutex_unlock(&lock);
    *ctx = &primary[device];
    note("cuDevicePrimaryCtxRetain %d", device);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    NEED_INIT();
    if (device < 0 || device >= MAX_DEVICES) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    CUresult r = primary[device].retained > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    if (r == CUDA_SUCCESS) primary[device].retained--;
    pthread_mutex_unlock(&lock);
    note("cuDevicePrimaryCtxRelease_v2 %d", device);
    return r;
}

STANDIN_EXPORT CUresult cuCtxGetCurrent(void **ctx) {
    NEED_INIT();
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    *ctx = current;
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuCtxSetCurrent(void *ctx) {
    NEED_INIT();
    struct standin_context *c = ctx;
    if (c && c->magic != CTX_MAGIC) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    int fail = 0;
    if (set_current_before_failing > 0)
        set_current_before_failing--;
    else if (failing_set_current > 0) {
        fail = 1;
        failing_set_current--;
    }
    pthread_mutex_unlock(&lock);
    if (fail) {
        note("cuCtxSetCurrent %d FAILED", ctx_id(c));
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    current = c;
    note("cuCtxSetCurrent %d", ctx_id(c));
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuCtxSynchronize(void) {
    NEED_CONTEXT("cuCtxSynchronize");
    pthread_mutex_lock(&lock);
    for (struct standin_event *e = events; e; e = e->next) e->complete = 1;
    pthread_mutex_unlock(&lock);
    note("cuCtxSynchronize ctx=%d", ctx_id(current));
    return CUDA_SUCCESS;
}

/* -- memory ------------------------------------------------------------------------------------ */
STANDIN_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    NEED_CONTEXT("cuMemGetInfo_v2");
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    *total = memory_limit;
    *free_bytes = device_bytes < memory_limit ? memory_limit - device_bytes : 0;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t len) {
    NEED_CONTEXT("cuMemAlloc_v2");
    if (!out || len == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    if (len > memory_limit || device_bytes > memory_limit - len) {
        pthread_mutex_unlock(&lock);
        note("cuMemAlloc_v2 %zu OUT_OF_MEMORY", len);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t rounded = (len + 255) & ~(size_t)255;
    void *p = aligned_alloc(256, rounded);
    if (!p || !track((uintptr_t)p, len, 0)) {
        free(p);
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    /* Fresh device memory holds garbage: make it visible garbage. */
    memset(p, 0xA5, len);
    device_bytes += len;
    pthread_mutex_unlock(&lock);
    *out = (CUdeviceptr)(uintptr_t)p;
    note("cuMemAlloc_v2 %#llx %zu ctx=%d", *out, len, ctx_id(current));
    return CUDA_SUCCESS;
}

static void delay(void) {
    long us = free_delay_us;
    if (us > 0) {
        struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
}

STANDIN_EXPORT CUresult cuMemFree_v2(CUdeviceptr ptr) {
    NEED_CONTEXT("cuMemFree_v2");
    note("cuMemFree_v2 %#llx begin", ptr);
    delay();
    pthread_mutex_lock(&lock);
    if (failing_frees > 0) {
        failing_frees--;
        pthread_mutex_unlock(&lock);
        note("cuMemFree_v2 %#llx FAILED", ptr);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct allocation *a = find_base((uintptr_t)ptr, 0);
    if (!a) {
        pthread_mutex_unlock(&lock);
        note("cuMemFree_v2 %#llx INVALID_VALUE (not an allocation)", ptr);
        return CUDA_ERROR_INVALID_VALUE;
    }
    device_bytes -= a->len;
    *a = allocations[--n_allocations];
    pthread_mutex_unlock(&lock);
    note("cuMemFree_v2 %#llx", ptr);
    free((void *)(uintptr_t)ptr);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuMemHostAlloc(void **out, size_t len, unsigned int flags) {
    NEED_CONTEXT("cuMemHostAlloc");
    if (!out || len == 0) return CUDA_ERROR_INVALID_VALUE;
    if (len > memory_limit) {
        note("cuMemHostAlloc %zu OUT_OF_MEMORY", len);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t rounded = (len + 4095) & ~(size_t)4095;
    void *p = aligned_alloc(4096, rounded);
    pthread_mutex_lock(&lock);
    if (!p || !track((uintptr_t)p, len, 1)) {
        pthread_mutex_unlock(&lock);
        free(p);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    host_bytes += len;
    pthread_mutex_unlock(&lock);
    memset(p, 0x5A, len);
    *out = p;
    note("cuMemHostAlloc %p %zu flags=%u", p, len, flags);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuMemFreeHost(void *p) {
    NEED_CONTEXT("cuMemFreeHost");
    note("cuMemFreeHost %p begin", p);
    delay();
    pthread_mutex_lock(&lock);
    struct allocation *a = find_base((uintptr_t)p, 1);
    if (!a) {
        pthread_mutex_unlock(&lock);
        note("cuMemFreeHost %p INVALID_VALUE (not an allocation)", p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    host_bytes -= a->len;
    *a = allocations[--n_allocations];
    pthread_mutex_unlock(&lock);
    note("cuMemFreeHost %p", p);
    free(p);
    return CUDA_SUCCESS;
}

/* Whether the next fill or device-to-device copy fails (standin_set_failing_copies). */
static int copy_fails(void) {
    pthread_mutex_lock(&lock);
    int fail = failing_copies > 0;
    if (fail) failing_copies--;
    pthread_mutex_unlock(&lock);
    return fail;
}

STANDIN_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) {
    NEED_CONTEXT("cuMemsetD8_v2");
    if (copy_fails()) {
        note("cuMemsetD8_v2 %#llx %zu LAUNCH_FAILED (injected)", dst, n);
        return CUDA_ERROR_LAUNCH_FAILED;
    }
    if (!in_device_memory(dst, n)) {
        note("cuMemsetD8_v2 %#llx %zu INVALID_VALUE (outside device memory)", dst, n);
        return CUDA_ERROR_INVALID_VALUE;
    }
    memset((void *)(uintptr_t)dst, value, n);
    note("cuMemsetD8_v2 %#llx %zu", dst, n);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    NEED_CONTEXT("cuMemcpyHtoD_v2");
    if (!in_device_memory(dst, n)) {
        note("cuMemcpyHtoD_v2 %#llx %zu INVALID_VALUE (outside device memory)", dst, n);
        return CUDA_ERROR_INVALID_VALUE;
    }
    memcpy((void *)(uintptr_t)dst, src, n);
    note("cuMemcpyHtoD_v2 %#llx %zu", dst, n);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    NEED_CONTEXT("cuMemcpyDtoH_v2");
    if (!in_device_memory(src, n)) {
        note("cuMemcpyDtoH_v2 %#llx %zu INVALID_VALUE (outside device memory)", src, n);
        return CUDA_ERROR_INVALID_VALUE;
    }
    memcpy(dst, (const void *)(uintptr_t)src, n);
    note("cuMemcpyDtoH_v2 %#llx %zu", src, n);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    NEED_CONTEXT("cuMemcpyDtoD_v2");
    if (copy_fails()) {
        note("cuMemcpyDtoD_v2 %#llx %#llx %zu LAUNCH_FAILED (injected)", dst, src, n);
        return CUDA_ERROR_LAUNCH_FAILED;
    }
    if (!in_device_memory(dst, n) || !in_device_memory(src, n)) {
        note("cuMemcpyDtoD_v2 %#llx %#llx %zu INVALID_VALUE (outside device memory)", dst, src, n);
        return CUDA_ERROR_INVALID_VALUE;
    }
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    note("cuMemcpyDtoD_v2 %#llx %#llx %zu", dst, src, n);
    return CUDA_SUCCESS;
}

/* -- streams and events ------------------------------------------------------------------------- */
static int stream_ok(void *s) {
    uintptr_t v = (uintptr_t)s;
    if (v == 0 || v == 1 || v == 2) return 1;
    int magic = ((struct standin_stream *)s)->magic;
    if (magic == DEAD_STREAM_MAGIC) note("DESTROYED STREAM %p used", s);
    return magic == STREAM_MAGIC;
}

STANDIN_EXPORT CUresult cuStreamCreate(void **out, unsigned int flags) {
    NEED_CONTEXT("cuStreamCreate");
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    struct standin_stream *s = malloc(sizeof *s);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = STREAM_MAGIC;
    s->flags = flags;
    pthread_mutex_lock(&lock);
    s->next = streams;
    streams = s;
    pthread_mutex_unlock(&lock);
    *out = s;
    note("cuStreamCreate %p flags=%u", (void *)s, flags);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuStreamDestroy_v2(void *stream) {
    NEED_CONTEXT("cuStreamDestroy_v2");
    struct standin_stream *s = stream;
    if ((uintptr_t)stream <= 2 || !stream_ok(stream)) return CUDA_ERROR_INVALID_HANDLE;
    note("cuStreamDestroy_v2 %p", stream);
    s->magic = DEAD_STREAM_MAGIC; /* kept, never freed: a later use is caught, not undefined */
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuStreamGetFlags(void *stream, unsigned int *flags) {
    NEED_CONTEXT("cuStreamGetFlags");
    if (!flags || !stream_ok(stream)) return CUDA_ERROR_INVALID_HANDLE;
    *flags = (uintptr_t)stream <= 2 ? 0 : ((struct standin_stream *)stream)->flags;
    note("cuStreamGetFlags %p flags=%u", stream, *flags);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuStreamSynchronize(void *stream) {
    NEED_CONTEXT("cuStreamSynchronize");
    if (!stream_ok(stream)) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    for (struct standin_event *e = events; e; e = e->next)
        if (e->stream == stream) e->complete = 1;
    pthread_mutex_unlock(&lock);
    note("cuStreamSynchronize %p", stream);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuStreamWaitEvent(void *stream, void *event, unsigned int flags) {
    NEED_CONTEXT("cuStreamWaitEvent");
    struct standin_event *e = event;
    if (!stream_ok(stream) || !e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    note("cuStreamWaitEvent %p %p flags=%u", stream, event, flags);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuEventCreate(void **out, unsigned int flags) {
    NEED_CONTEXT("cuEventCreate");
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    struct standin_event *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = EVENT_MAGIC;
    e->complete = 1;
    pthread_mutex_lock(&lock);
    e->next = events;
    events = e;
    pthread_mutex_unlock(&lock);
    *out = e;
    note("cuEventCreate %p flags=%u", (void *)e, flags);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuEventRecord(void *event, void *stream) {
    NEED_CONTEXT("cuEventRecord");
    struct standin_event *e = event;
    if (!e || e->magic != EVENT_MAGIC || !stream_ok(stream)) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    e->stream = stream;
    e->complete = !events_pending;
    pthread_mutex_unlock(&lock);
    note("cuEventRecord %p %p", event, stream);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuEventQuery(void *event) {
    NEED_CONTEXT("cuEventQuery");
    struct standin_event *e = event;
    if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    int done = e->complete;
    pthread_mutex_unlock(&lock);
    note("cuEventQuery %p %s", event, done ? "complete" : "NOT_READY");
    return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

STANDIN_EXPORT CUresult cuEventSynchronize(void *event) {
    NEED_CONTEXT("cuEventSynchronize");
    struct standin_event *e = event;
    if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    e->complete = 1;
    pthread_mutex_unlock(&lock);
    note("cuEventSynchronize %p", event);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuEventDestroy_v2(void *event) {
    NEED_CONTEXT("cuEventDestroy_v2");
    struct standin_event *e = event;
    if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    for (struct standin_event **p = &events; *p; p = &(*p)->next) {
        if (*p == e) {
            *p = e->next;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    note("cuEventDestroy_v2 %p", event);
    e->magic = 0;
    free(e);
    return CUDA_SUCCESS;
}
