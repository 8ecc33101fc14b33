/*
 * pingpong.c: two processes pinned to one CPU pass a byte back and forth
 * through two pipes; each pass is one context switch. Prints the number of
 * switches and the nanoseconds each took. Built and run by
 * bench/switch_cost.py.
 *
 * usage: pingpong ROUND_TRIPS
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 100000;
    int ab[2], ba[2];
    char c = 0;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(0, &one);
    if (sched_setaffinity(0, sizeof(one), &one) || pipe(ab) || pipe(ba))
        return 1;
    pid_t child = fork();
    if (child == 0) {
        for (long i = 0; i < n; i++)
            if (read(ab[0], &c, 1) != 1 || write(ba[1], &c, 1) != 1)
                _exit(1);
        _exit(0);
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++)
        if (write(ab[1], &c, 1) != 1 || read(ba[0], &c, 1) != 1)
            return 1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    waitpid(child, NULL, 0);
    double ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
    printf("%ld %.1f\n", 2 * n, ns / (2 * n));
    return 0;
}
