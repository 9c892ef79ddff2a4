/* The fastest 2-rank all-reduce of 64 MiB of f32 that this machine's memory allows, as a
 * yardstick for `ds-rs bench comm` over shared memory.
 *
 * Both ranks' buffers live in one shared mapping, so nothing is staged: per slice each rank
 * sums its half from both buffers into its own, then copies the other half from its peer.
 * Every input byte is read once and every output byte written once, the least memory
 * traffic any algorithm can have (ds-rs must copy through rings, since a user's buffer is
 * private to its process). Spin flags order the phases.
 *
 *   gcc -O3 -march=native -o /tmp/shm_bound scripts/bench/shm_allreduce_bound.c && /tmp/shm_bound
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define COUNT ((64u << 20) / 4)
#define PART 65536 /* elements of a rank's half of one slice */
#define WARMUP 3
#define ITERS 10

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Raises this rank's counter and waits until the peer's reaches it. */
static void sync_with(_Atomic unsigned long *mine, _Atomic unsigned long *peer, unsigned long *n) {
    atomic_store(mine, ++*n);
    while (atomic_load(peer) < *n)
        ;
}

int main(void) {
    char *m = mmap(0, 2 * (size_t)COUNT * 4 + 8192, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return perror("mmap"), 1;
    float *buf[2] = {(float *)(m + 8192), (float *)(m + 8192) + COUNT};
    _Atomic unsigned long *flag[2] = {(void *)m, (void *)(m + 4096)};
    int me = fork() != 0 ? 0 : 1, pe = 1 - me;
    for (size_t i = 0; i < COUNT; i++) buf[me][i] = (float)(me + 1);
    unsigned long n = 0;
    double t[WARMUP + ITERS];
    for (int it = 0; it < WARMUP + ITERS; it++) {
        double t0 = now();
        sync_with(flag[me], flag[pe], &n);
        for (size_t s = 0; s < COUNT; s += 2 * PART) {
            float *d = buf[me] + s + me * PART, *o = buf[pe] + s + me * PART;
            for (size_t i = 0; i < PART; i++) d[i] += o[i];
            sync_with(flag[me], flag[pe], &n);
            memcpy(buf[me] + s + pe * PART, buf[pe] + s + pe * PART, PART * 4);
        }
        sync_with(flag[me], flag[pe], &n);
        t[it] = now() - t0;
    }
    if (me == 1) return 0;
    wait(0);
    /* every element doubled (1+2=3, then 3+3, ...): 3 * 2^(iterations-1) */
    float expect = 3.0f * (float)(1u << (WARMUP + ITERS - 1));
    qsort(t + WARMUP, ITERS, sizeof t[0], cmp);
    double med = t[WARMUP + ITERS / 2];
    printf("{\"bench\": \"shm_allreduce_bound\", \"bytes\": %u, \"time_us\": %.1f, "
           "\"busbw_gbs\": %.2f, \"correct\": %s}\n",
           COUNT * 4, med * 1e6, COUNT * 4.0 / med / 1e9,
           buf[0][12345] == expect ? "true" : "false");
    return 0;
}
