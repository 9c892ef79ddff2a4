// Where a GPU process's time goes, kernel by kernel, without nsys (issue 35's breakdown): a
// CUPTI injection library. The CUDA driver loads it into any process started with
//   CUDA_INJECTION64_PATH=/path/libds_kernel_profile.so DS_KERNEL_PROFILE=report.tsv
// and calls InitializeInjection at cuInit; CUPTI's activity API then records every kernel,
// copy and memset with its GPU start and end; at exit the totals by name go to
// $DS_KERNEL_PROFILE (stderr when unset), largest first:
//   # ds-kernel-profile: <records> records, <busy> ms on the GPU, first to last <span> ms
//   total_ms <TAB> calls <TAB> mean_us <TAB> name
// scripts/gpu-bundle.sh builds it (the CUPTI headers and library come with
// scripts/install-cuda-toolchain.sh); scripts/gpu-acceptance.sh runs a gpt2 bench under it and
// groups the names into kernel families.
#include <cupti.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUFFER_BYTES (8u << 20)

struct entry {
    char *name;
    uint64_t calls, ns;
};

static struct entry *entries;
static size_t n_entries, cap_entries;
static uint64_t records, busy_ns, first_start = UINT64_MAX, last_end;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

// One activity of `name` from `start` to `end` (ns). Linear search: a training step has a few
// hundred distinct kernels at most, and this runs when CUPTI hands a buffer back, off the
// GPU's path.
static void add(const char *name, uint64_t start, uint64_t end) {
    uint64_t ns = end > start ? end - start : 0;
    pthread_mutex_lock(&lock);
    records++;
    busy_ns += ns;
    if (start < first_start) first_start = start;
    if (end > last_end) last_end = end;
    size_t i = 0;
    while (i < n_entries && strcmp(entries[i].name, name) != 0) i++;
    if (i == n_entries) {
        if (n_entries == cap_entries) {
            cap_entries = cap_entries ? 2 * cap_entries : 256;
            entries = realloc(entries, cap_entries * sizeof *entries);
        }
        entries[n_entries++] = (struct entry){strdup(name ? name : "?"), 0, 0};
    }
    entries[i].calls++;
    entries[i].ns += ns;
    pthread_mutex_unlock(&lock);
}

static const char *copy_name(uint8_t kind) {
    switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "[memcpy host to device]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "[memcpy device to host]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "[memcpy device to device]";
    default: return "[memcpy other]";
    }
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(8, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer,
                                      size_t size, size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *r = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
        switch (r->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
            CUpti_ActivityKernel10 *k = (CUpti_ActivityKernel10 *)r;
            add(k->name, k->start, k->end);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            CUpti_ActivityMemcpy6 *m = (CUpti_ActivityMemcpy6 *)r;
            add(copy_name(m->copyKind), m->start, m->end);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            CUpti_ActivityMemset4 *m = (CUpti_ActivityMemset4 *)r;
            add("[memset]", m->start, m->end);
            break;
        }
        default: break;
        }
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped)
        fprintf(stderr, "ds-kernel-profile: CUPTI dropped %zu records\n", dropped);
    free(buffer);
}

static int by_time(const void *a, const void *b) {
    const struct entry *x = a, *y = b;
    return x->ns < y->ns ? 1 : x->ns > y->ns ? -1 : 0;
}

static void report(void) {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    const char *path = getenv("DS_KERNEL_PROFILE");
    FILE *out = path && *path ? fopen(path, "w") : stderr;
    if (!out) {
        fprintf(stderr, "ds-kernel-profile: cannot write %s\n", path);
        return;
    }
    pthread_mutex_lock(&lock);
    qsort(entries, n_entries, sizeof *entries, by_time);
    double span = last_end > first_start ? (last_end - first_start) / 1e6 : 0.0;
    fprintf(out, "# ds-kernel-profile: %llu records, %.3f ms on the GPU, first to last %.3f ms\n",
            (unsigned long long)records, busy_ns / 1e6, span);
    fprintf(out, "total_ms\tcalls\tmean_us\tname\n");
    for (size_t i = 0; i < n_entries; i++)
        fprintf(out, "%.3f\t%llu\t%.2f\t%s\n", entries[i].ns / 1e6,
                (unsigned long long)entries[i].calls,
                entries[i].ns / 1e3 / (double)entries[i].calls, entries[i].name);
    pthread_mutex_unlock(&lock);
    if (out != stderr) fclose(out);
}

// The driver's entry point for CUDA_INJECTION64_PATH libraries.
int InitializeInjection(void) {
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) {
        fprintf(stderr, "ds-kernel-profile: CUPTI refused the activity callbacks\n");
        return 0;
    }
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
    atexit(report);
    return 1;
}
