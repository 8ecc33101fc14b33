/*
 * ring_reader.c: the kernel's sample ring read as the agent reads it
 * (sampler/kernel/sample_ring.py: the count, a fence, the entries, a fence,
 * the count again, entries the kernel may have written over dropped), as fast
 * as a CPU can: nanoseconds between the count's load and the entries', where
 * Python's reader leaves microseconds, so that a sample published before it
 * is written, or read before the count, shows here. Compiled and run by
 * tests/test_kernel_samples.py's publication test.
 *
 *   ring_reader HEAD_FD TIME_FD RING_LEN SECONDS MIN_READS
 *
 * HEAD_FD and TIME_FD: the sample_head and sample_time maps (inherited).
 * Reads for SECONDS and until it has made MIN_READS reads of new samples (a
 * loaded machine gives it fewer a second), for at most a minute more.
 * Prints "read N lost N disorder N reads N": disorder counts the samples
 * whose time is not after the one before, or whose busy time over the same
 * CPUs is less (an entry of the ring's lap before, or torn).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

struct sample_time { /* bpf/sched_groups.bpf.c's */
    uint64_t at, busy, steal;
    uint32_t gen, cpus;
};

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: ring_reader HEAD_FD TIME_FD RING_LEN SECONDS MIN_READS\n");
        return 2;
    }
    int head_fd = atoi(argv[1]), time_fd = atoi(argv[2]);
    uint64_t ring_len = strtoull(argv[3], NULL, 10);
    double seconds = atof(argv[4]);
    uint64_t min_reads = strtoull(argv[5], NULL, 10);
    volatile uint64_t *written = mmap(NULL, 64, PROT_READ, MAP_SHARED, head_fd, 0);
    volatile struct sample_time *ring =
        mmap(NULL, ring_len * sizeof(struct sample_time), PROT_READ, MAP_SHARED, time_fd, 0);
    struct sample_time *got = malloc(ring_len * sizeof(struct sample_time));
    if (written == MAP_FAILED || ring == MAP_FAILED || !got) {
        perror("ring_reader");
        return 1;
    }
    uint64_t read = 0, lost = 0, disorder = 0, reads = 0, last = *written;
    struct sample_time prev = {0};
    int have_prev = 0;
    double until = now() + seconds, limit = until + 60;
    for (double t = now(); (t < until || reads < min_reads) && t < limit; t = now()) {
        uint64_t n = *written;
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (n == last)
            continue;
        uint64_t start = n - last >= ring_len ? n - ring_len + 1 : last;
        for (uint64_t k = start; k < n; k++) {
            volatile struct sample_time *e = &ring[k % ring_len];
            got[k - start] = (struct sample_time){e->at, e->busy, e->steal, e->gen, e->cpus};
        }
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        uint64_t after = *written;
        lost += start - last;
        for (uint64_t k = start; k < n; k++) {
            if (k + ring_len <= after) { /* the kernel may have begun to write it again */
                lost++;
                continue;
            }
            struct sample_time *s = &got[k - start];
            if (have_prev && (s->at <= prev.at || (s->cpus == prev.cpus && s->busy < prev.busy)))
                disorder++;
            prev = *s;
            have_prev = 1;
            read++;
        }
        last = n;
        reads++;
    }
    printf("read %lu lost %lu disorder %lu reads %lu\n", (unsigned long)read, (unsigned long)lost,
           (unsigned long)disorder, (unsigned long)reads);
    return 0;
}
