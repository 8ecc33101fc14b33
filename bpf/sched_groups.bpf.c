/*
 * sched_groups.bpf.c: on-CPU nanoseconds per watched process group.
 * Loaded by sampler/kernel/sched.py (bcc), which sets the constants below as
 * -D cflags and writes the watched processes into `task_slot`.
 *
 * The scheduler already accounts each task's on-CPU time
 * (se.sum_exec_runtime, brought up to date before sched_switch fires). Each
 * CPU remembers the group of the watched task it switched in, that task's
 * runtime then, and when (`since`, CLOCK_MONOTONIC); at the switch out, the
 * runtime's growth is credited to the group: the slot's total is exact.
 *
 * A sample does not wait for the switch out: userspace reads each CPU's
 * `cpu_run` beside the totals and counts a watched task still on a CPU from
 * `since` up to the sample's own clock reading, so time is credited to the
 * sample in which it was spent, at any rate (a task that never switches out
 * included). `seq` is odd while a CPU updates its entry and the totals
 * (a sequence lock): userspace reads every `seq`, then the entries and the
 * totals, then every `seq` again, and takes only the CPUs whose `seq` was
 * even and did not move. No clock is read on a switch between
 * two unwatched tasks.
 *
 * Some kernels switch tasks without this tracepoint now and then (the CI
 * host's did, a few times a second, its switch count running ahead of the
 * program's runs): each CPU remembers the task it was last seen switching
 * to, and a switch out of another task, or a tick in one, shows a switch in
 * that was not seen. That task's slice is then what its runtime grew since
 * the fair class picked it (se.prev_sum_exec_runtime), at most a tick's
 * period (longer, the tick would have found it first); a task of another
 * class keeps no such mark and its unseen slice is not counted. Such time
 * is credited late (`late`: userspace spreads it over the samples after).
 * The slice the CPU was counting belonged to a task whose switch out was
 * not seen either: its end is unknown, and it is dropped.
 *
 * The credit of a slice is its runtime's growth; for a task learnt at the
 * cpu-clock tick (it was running when userspace gave it a slot), at most the
 * time since the tick: its runtime then was the last scheduler tick's, and
 * it counts from the tick, not from its switch in. (Capping every slice at
 * its wall time would lose the microseconds between the scheduler's clock
 * reading and this tracepoint, at every switch.)
 *
 * Membership lives in the kernel: a process forked by a member joins its
 * parent's slot at fork, so it counts from its first slice even if it exits
 * before userspace could see it; its entry is cleared when it exits, so a
 * reused pid starts with no group.
 *
 * task_slot is an array indexed by tgid, one byte each (0: not watched), eight
 * to an element: bounded by pid_max, looked up without hashing, written with
 * single-byte stores (no read-modify-write between CPUs), and mmapped by
 * userspace, which reads and writes it as a numpy array.
 *
 * How long watched tasks wait for a CPU: the scheduler keeps each task's
 * total run-queue wait (sched_info.run_delay, CONFIG_SCHED_INFO), brought up
 * to date when the task is switched in. At each switch out of a watched task
 * its growth since the task's previous switch out is the wait before the
 * slice that just ended: one entry in the slot's log2 histogram. No clock is
 * read for it (bpf_ktime_get_ns costs ~40 ns on our VMs).
 *
 * No kernel struct is read through the compile-time headers (they may not be
 * the running kernel's): offsets come from the running kernel's BTF
 * (TASK_PID_OFF, TASK_TGID_OFF, TASK_POLICY_OFF, TASK_RUNTIME_OFF,
 * TASK_PICKED_RUNTIME_OFF, TASK_RUN_DELAY_OFF, TASK_SIGNAL_OFF,
 * SIGNAL_LIVE_OFF), read by the loader.
 *
 * A field of a task is read by a plain load where the verifier knows the
 * pointer's BTF type (`typed`), else through bpf_probe_read_kernel (~15 ns a
 * call on our VMs, which at a watched switch made most of its cost):
 * - sched_switch is loaded as a BTF-typed tracepoint (tp_btf, by the loader:
 *   on_switch) wherever the kernel's BTF names it: both tasks are typed. The
 *   raw tracepoint (on_switch_raw) is the fallback.
 * - the current task is typed from 5.11 (bpf_get_current_task_btf).
 */

/* The kernel's own headers define it; the bundled ones (bpf/include/) do not. */
#ifndef __always_inline
#define __always_inline inline __attribute__((always_inline))
#endif
#ifndef PID_MAX
#define PID_MAX 4194304
#endif
#ifndef MAX_SLOTS
#define MAX_SLOTS 256
#endif
#ifndef TICK_NS
#define TICK_NS 10000000
#endif
#ifndef NR_CPUS
#define NR_CPUS 1 /* the loader passes the possible CPUs' highest id + 1 */
#endif
#ifndef barrier /* the kernel's headers, where bcc compiles against them, define it so */
#define barrier() asm volatile("" ::: "memory")
#endif

/* Memory order for readers on other CPUs (on_sample, and the agent through
 * the mapped arrays: sampler/kernel/memory_order.py). x86 keeps stores in
 * order and loads in order: the compiler's barrier is enough. arm64 does not,
 * and BPF has no fence instruction (load-acquire came in 6.15), but a
 * fetching atomic is fully ordered in every JIT (arm64: SWPAL, or an LL/SC
 * loop ended by DMB ISH; x86: XCHG). A plain atomic add orders nothing on
 * arm64 (STADD). Which fetching atomic: bcc 0.32 and later compile for BPF's
 * first CPU version (v1), where LLVM 20 and later refuse a fetching add, with
 * a fatal error ("Invalid usage of the XADD return value": Debian sid's bcc
 * 0.37); an exchange is v1's (compiled and loaded with bcc 0.26 and LLVM 14,
 * 0.31, and 0.37), and x86 runs it as one instruction, where a fetching or
 * is a LOCK CMPXCHG loop (bench/switch_cost.py --against, this host: the or
 * in on_sample's fences, 379 ns a sample against 290 with fetching adds; the
 * exchange, 284 against 319, and 85 ns a watched switch against 84). Its result is
 * kept, in a register an empty asm claims, so that clang cannot make it a
 * plain store. Fetching atomics came in
 * 5.12 (FETCH_ATOMICS, set by the loader); on an older kernel the source's
 * order is kept, which is the memory's on x86 alone (the loader refuses other
 * CPUs there).
 * ordered_add: a full fence and an add, for a word a writer publishes by; the
 * word's only writer adds (its CPU's row, or the one CPU that samples), so an
 * exchange with the sum is the add.
 * fence: a full fence, an exchange with a scratch word of the caller's CPU. */
#ifdef FETCH_ATOMICS
#define ordered_add(p, n)                                                                                              \
    do {                                                                                                               \
        __typeof__(*(p)) was_ = __atomic_exchange_n((p), *(p) + (n), __ATOMIC_SEQ_CST);                                \
        asm volatile("" : "+r"(was_)::"memory");                                                                       \
    } while (0)
#define fence(scratch)                                                                                                 \
    do {                                                                                                               \
        __typeof__(*(scratch)) was_ = __atomic_exchange_n((scratch), 1, __ATOMIC_SEQ_CST);                             \
        asm volatile("" : "+r"(was_)::"memory");                                                                       \
    } while (0)
#else
#define ordered_add(p, n)                                                                                              \
    do {                                                                                                               \
        barrier();                                                                                                     \
        *(p) += (n);                                                                                                   \
        barrier();                                                                                                     \
    } while (0)
#define fence(scratch) barrier()
#endif

/* tgid / 8 -> eight one-byte slots. BPF_F_MMAPABLE: userspace maps it. */
BPF_F_TABLE("array", u32, u64, task_slot, (PID_MAX + 7) / 8, BPF_F_MMAPABLE);
/* cpu * MAX_SLOTS + slot -> on-CPU ns, cumulative: never cleared, userspace
 * takes deltas. `late`: the part of `ns` spent before userspace could count
 * it as running (slices whose switch in was not seen, and what a slice grew
 * beyond its wall time); userspace spreads it over the samples that follow,
 * as far as their threads had room.
 *
 * This and cpu_run are read at every sample: plain arrays with a row per CPU,
 * each CPU writing its own (a 4 KiB row, a 64-byte entry: no cache line
 * shared between CPUs), rather than per-CPU maps, so that userspace maps
 * them (BPF_F_MMAPABLE) and a sample reads them in place, without a system
 * call. */
struct slot_time {
    u64 ns;
    u64 late;
};
/* A CPU's row: one element, so that a reader of every slot (on_sample) looks
 * it up once; laid out as NR_CPUS * MAX_SLOTS entries all the same. */
struct slot_row {
    struct slot_time t[MAX_SLOTS];
};
BPF_F_TABLE("array", u32, struct slot_row, slot_ns, NR_CPUS, BPF_F_MMAPABLE);

/* What each CPU is running: its task's slot, that task's runtime when it was
 * switched in (or learnt), and when (ns, CLOCK_MONOTONIC). Read by userspace.
 * `task`: the task it was last seen switching to, watched or not; compared
 * with the task switching out, never read through. */
struct cpu_run {
    u64 start;
    u64 since;
    u64 task;
    u64 seq;    /* 64 bits: bcc's clang fetches atomically at 64 bits alone (ordered_add) */
    u32 slot;
    u32 learnt; /* 1: learnt at the tick, `start` may be stale */
    u64 spare[3]; /* to 64 bytes: one cache line per CPU */
};
BPF_F_TABLE("array", u32, struct cpu_run, cpu_run, NR_CPUS, BPF_F_MMAPABLE);

/* This CPU's entries. Programs on one CPU do not nest (the kernel runs no BPF
 * program inside another on the same CPU), so no atomics are needed for the
 * writes themselves; `seq`'s are atomics for their order alone (ordered_add). */
static __always_inline struct cpu_run *this_cpu_run(void)
{
    u32 cpu = bpf_get_smp_processor_id();
    return cpu_run.lookup(&cpu);
}

/* The empty asm keeps the compiler from computing the entry's address before
 * the null check (newer clangs do, and the verifier refuses arithmetic on a
 * pointer that may be null). */
static __always_inline struct slot_time *this_cpu_slot(u32 slot)
{
    u32 cpu = bpf_get_smp_processor_id();
    struct slot_row *row = slot_ns.lookup(&cpu);
    if (!row)
        return 0;
    asm volatile("" : "+r"(row));
    return &row->t[slot & (MAX_SLOTS - 1)];
}
/* Forked processes that could not be given a slot (tgid above PID_MAX). */
BPF_PERCPU_ARRAY(dropped_forks, u64, 1);

/* The current task; typed from 5.11 (bpf_get_current_task_btf). */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(5, 11, 0)
#define current_task() ((void *)bpf_get_current_task_btf())
#define CURRENT_TYPED 1
#else
/* bpf_get_current_task under another name: bcc rewrites every dereference of
 * a pointer it sees come from that helper (by name) into a helper call, in
 * every function the pointer is passed to: the typed reads of on_switch
 * included. This program reads the untyped task through read_u64 itself. */
static u64 (*current_task_untyped)(void) = (void *)BPF_FUNC_get_current_task;
#define current_task() ((void *)current_task_untyped())
#define CURRENT_TYPED 0
#endif

static __always_inline u64 read_u64(void *where)
{
    u64 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), where);
    return v;
}

static __always_inline u32 read_u32(void *where)
{
    u32 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), where);
    return v;
}

/* A task's field. `typed` is a constant at every call: each program keeps
 * only its own kind of read. */
static __always_inline u64 task_u64(void *task, u32 off, const int typed)
{
    return typed ? *(u64 *)(task + off) : read_u64(task + off);
}

static __always_inline u32 task_u32(void *task, u32 off, const int typed)
{
    return typed ? *(u32 *)(task + off) : read_u32(task + off);
}

#define WAIT_BUCKETS 32
#ifdef TASK_RUN_DELAY_OFF
/* tid -> its run_delay at its last switch out, | 1 (0: not seen). 64 bits: a
 * starved task waits seconds, and 32 bits of nanoseconds wrap at 4.29 s. */
BPF_ARRAY(last_delay, u64, PID_MAX);
/* slot -> its waits, per CPU, cumulative: one lookup a switch out for both. */
struct wait_log {
    u64 ns;                  /* ns waited */
    u64 count[WAIT_BUCKETS]; /* waits by log2(ns); the last bucket holds every longer one */
};
BPF_PERCPU_ARRAY(wait_log, struct wait_log, MAX_SLOTS);

/* `me`: the task switching out, current. */
static __always_inline void record_wait(void *me, u32 slot, const int typed)
{
    u32 pid = bpf_get_current_pid_tgid();
    u64 delay = task_u64(me, TASK_RUN_DELAY_OFF, typed);
    u64 *last = last_delay.lookup(&pid);
    if (!last)
        return;
    u64 now = delay | 1, before = *last;
    *last = now;
    if (!before || now < before) /* first sight (or a tid reused unseen): a baseline, not a wait */
        return;
    u64 waited = now - before;
    struct wait_log *log = wait_log.lookup(&slot);
    if (!log)
        return;
    u32 bucket = waited ? bpf_log2l(waited) : 0;
    if (bucket >= WAIT_BUCKETS)
        bucket = WAIT_BUCKETS - 1;
    /* The verifiers of 5.10 and 6.1 lose the clamp's bound on the way to the
     * index (and refuse the program); the mask gives them one, and the empty
     * asm keeps the compiler from dropping the mask as redundant. */
    asm volatile("" : "+r"(bucket));
    log->count[bucket & (WAIT_BUCKETS - 1)] += 1;
    log->ns += waited;
}
#endif

static __always_inline u8 *slot_of(u32 tgid)
{
    u32 idx = tgid / 8;
    u64 *eight = task_slot.lookup(&idx);
    return eight ? (u8 *)eight + (tgid & 7) : 0;
}

/* Credit the slice that ends now to its slot: its runtime's growth (for a
 * slice learnt at the tick, at most the wall time since then). What it grew
 * beyond its wall time since `since` was spent before userspace counted the
 * slice as running (the scheduler's clock starts a slice at its pick, a
 * tick-learnt one's runtime was last brought up to date before the tick):
 * late. */
static __always_inline void credit(struct cpu_run *run, u64 runtime, u64 now)
{
    if (!run->slot || runtime <= run->start)
        return;
    u64 grown = runtime - run->start;
    u64 wall = now > run->since ? now - run->since : 0;
    if (run->learnt && grown > wall)
        grown = wall;
    struct slot_time *t = this_cpu_slot(run->slot);
    if (t) {
        t->ns += grown;
        if (grown > wall)
            t->late += grown - wall;
    }
}

/* Time spent before anyone could count it: credited, and marked late. */
static __always_inline void credit_late(u32 slot, u64 grown)
{
    struct slot_time *t = this_cpu_slot(slot);
    if (t && grown) {
        t->ns += grown;
        t->late += grown;
    }
}

/* What the current task (`me`), switched in unseen, has run since the fair
 * class picked it, at most a tick's period; 0 for a task of another class (no
 * such mark). */
static __always_inline u64 unseen_slice(void *me, u64 runtime, const int typed)
{
    u32 policy = task_u32(me, TASK_POLICY_OFF, typed);
    if (policy != 0 && policy != 3 && policy != 5) /* SCHED_NORMAL, SCHED_BATCH, SCHED_IDLE */
        return 0;
    u64 picked = task_u64(me, TASK_PICKED_RUNTIME_OFF, typed);
    if (runtime <= picked)
        return 0;
    return runtime - picked < TICK_NS ? runtime - picked : TICK_NS;
}

/* The task switching out (current: `me`) ends a slice whose start was not
 * seen: credit it to its slot (if any), and drop the slice this CPU was
 * counting (its task left unseen). */
static __always_inline void end_unseen(struct cpu_run *run, void *me, const int typed)
{
    run->slot = 0;
    u8 *slot = slot_of(bpf_get_current_pid_tgid() >> 32);
    if (slot && *slot)
        credit_late(*slot, unseen_slice(me, task_u64(me, TASK_RUNTIME_OFF, typed), typed));
}

/* The switch from `prev` (current) to `next`, as each entry point below reads
 * its arguments: args[1] and args[2] are (struct task_struct *prev, *next). */
static __always_inline int switch_tasks(u64 *args, const int typed)
{
    struct cpu_run *run = this_cpu_run();
    if (!run)
        return 0;
    void *prev = (void *)args[1], *next = (void *)args[2];
    u64 seen = run->task;
    run->task = (u64)next;
    u8 *slot = slot_of(task_u32(next, TASK_TGID_OFF, typed));
    u8 next_slot = slot ? *slot : 0;
    u8 unseen = seen && seen != (u64)prev;
    if (!run->slot && !next_slot && !unseen)
        return 0; /* unwatched to unwatched: the common case, no clock read */
    u64 now = bpf_ktime_get_ns();
    ordered_add(&run->seq, 1); /* odd: readers ignore this CPU until it is even again */
    /* prev is current: typed as an argument of tp_btf, or from 5.11 as current_task() */
    void *me = typed ? prev : current_task();
    const int me_typed = typed || CURRENT_TYPED;
    if (unseen)
        end_unseen(run, me, me_typed);
    if (run->slot) {
        credit(run, task_u64(me, TASK_RUNTIME_OFF, me_typed), now);
#ifdef TASK_RUN_DELAY_OFF
        record_wait(me, run->slot, me_typed);
#endif
    }
    run->slot = next_slot;
    if (next_slot) {
        run->start = task_u64(next, TASK_RUNTIME_OFF, typed);
        run->since = now;
        run->learnt = 0;
    }
    ordered_add(&run->seq, 1); /* even: after every write above */
    return 0;
}

/* tp_btf/sched_switch: loaded and attached by the loader (bcc cannot load a
 * function as tp_btf), with the kernel's BTF id of the tracepoint. */
int on_switch(u64 *ctx)
{
    return switch_tasks(ctx, 1);
}

/* raw_tracepoint/sched_switch, where on_switch cannot load. */
int on_switch_raw(struct bpf_raw_tracepoint_args *ctx)
{
    return switch_tasks(ctx->args, 0);
}

#ifdef RING_LEN
/* cpu -> its struct rq's address, once found (on_sample reads each CPU's
 * kernel_cpustat beside it) */
BPF_ARRAY(cpu_rq, u64, NR_CPUS);
#endif

#if defined(RING_LEN) && defined(RQ_FROM_TICK)
/* Where a task group's cfs_rq is one per-CPU pointer (7.2), which no program
 * can index by CPU, each CPU's rq is learnt by its own tick: the running
 * task's (the idle task's too) se.cfs_rq->rq, checked by rq.cpu. */
static __always_inline void learn_own_rq(void *task)
{
    u32 cpu = bpf_get_smp_processor_id();
    u64 *known = cpu_rq.lookup(&cpu);
    if (!known || *known)
        return;
    void *cfs_rq = (void *)read_u64(task + TASK_CFS_RQ_OFF);
    if (!cfs_rq)
        return;
    u64 rq = read_u64(cfs_rq + CFS_RQ_RQ_OFF);
    if (rq && read_u32((void *)rq + RQ_CPU_OFF) == cpu)
        *known = rq;
}
#endif

#ifdef SIGNAL_PGID_OFF
/* Membership followed by the tick, where a watched group alone decides the
 * slot of its processes (pgid, pid, cmdline and comm selectors; userspace
 * says so): a process seen running in a watched group takes the group's
 * slot, one that left for a group not watched loses its slot (setpgid,
 * setsid), both within a tick of their running, not at the next walk.
 *
 * pgid / 8 -> eight one-byte slots, the group's (0: not watched); written by
 * userspace through shared memory, as task_slot. */
BPF_F_TABLE("array", u32, u64, group_slot, (PID_MAX + 7) / 8, BPF_F_MMAPABLE);
/* slot / 8 -> eight bytes: 1 where the slot's processes are its groups'. */
BPF_F_TABLE("array", u32, u64, group_keyed, MAX_SLOTS / 8, BPF_F_MMAPABLE);
/* Processes the tick moved: [0] into a watched group, [1] out of one. */
BPF_ARRAY(tick_moves, u64, 2);
/* pgid -> the ticks that found one of its processes running, since
 * userspace last took them (a batch read that deletes what it reads): which
 * groups ran, and how much, without a walk of /proc. A group found when the
 * map is full is counted in group_ticks_full, and userspace walks /proc. */
#ifndef GROUP_TICKS_MAX
#define GROUP_TICKS_MAX 16384
#endif
BPF_HASH(group_ticks, u32, u32, GROUP_TICKS_MAX);
BPF_ARRAY(group_ticks_full, u64, 1);

static __always_inline void count_group_tick(u32 pgid)
{
    u32 *ticks = group_ticks.lookup(&pgid);
    if (ticks) {
        __sync_fetch_and_add(ticks, 1);
        return;
    }
    u32 one = 1;
    if (group_ticks.insert(&pgid, &one) == 0)
        return;
    ticks = group_ticks.lookup(&pgid); /* another CPU inserted it first */
    if (ticks) {
        __sync_fetch_and_add(ticks, 1);
        return;
    }
    u32 zero = 0;
    u64 *full = group_ticks_full.lookup(&zero);
    if (full)
        __sync_fetch_and_add(full, 1);
}

static __always_inline u8 *byte_of(u64 *eight, u32 i)
{
    return (u8 *)eight + (i & 7);
}

#ifndef PF_EXITING /* the kernel's headers, where bcc compiles against them, define it so */
#define PF_EXITING 0x00000004
#endif

/* cgroup id (the unified hierarchy's) -> the slot of a watched cgroup, where
 * watched cgroups alone decide the slots (cgroup: and k8s: selectors;
 * userspace says so, writing the cgroups of the watched paths and
 * containers): the tick follows a process moved into or out of one
 * (cgroup.procs) as it follows groups. */
#ifndef CGROUP_SLOTS_MAX
#define CGROUP_SLOTS_MAX 4096
#endif
BPF_HASH(cgroup_slot, u64, u8, CGROUP_SLOTS_MAX);
/* slot / 8 -> eight bytes: 1 where the slot's processes are its cgroups'. */
BPF_F_TABLE("array", u32, u64, cgroup_keyed, MAX_SLOTS / 8, BPF_F_MMAPABLE);

/* The running process's slot made `want`, its rule's (the group's or the
 * cgroup's); one the rule does not key (`keyed` 0) is some other rule's and
 * stays. */
static __always_inline void take_slot(u8 *slot, u8 want, u64 *keyed)
{
    u8 have = *slot;
    if (want == have)
        return;
    u32 moved = 0;
    if (!want) {
        if (!keyed || !*byte_of(keyed, have))
            return; /* a slot some other rule gave it */
        moved = 1;
    }
    *slot = want;
    u64 *n = tick_moves.lookup(&moved);
    if (n)
        __sync_fetch_and_add(n, 1);
}

/* The running process's group's tick counted, and its slot (`slot`, its
 * task_slot byte) made its group's or its cgroup's, whichever rule userspace
 * keys its slot by. Never for a thread on its way out (PF_EXITING), nor a
 * process whose last thread is (signal->live 0): sched_process_exit clears
 * the slot then, and a tick after it would give a dead pid a slot back. */
static __always_inline void follow_rules(u8 *slot, void *me)
{
    void *signal = (void *)task_u64(me, TASK_SIGNAL_OFF, CURRENT_TYPED);
    if (!signal)
        return;
    void *pid = (void *)read_u64(signal + SIGNAL_PGID_OFF);
    if (!pid)
        return;
    u32 pgid = read_u32(pid + PID_NR_OFF);
    if (!pgid)
        return; /* the kernel's threads */
    count_group_tick(pgid);
    if (task_u32(me, TASK_FLAGS_OFF, CURRENT_TYPED) & PF_EXITING)
        return;
    int live = 0;
    bpf_probe_read_kernel(&live, sizeof(live), signal + SIGNAL_LIVE_OFF);
    if (live <= 0)
        return;
    u32 at = pgid / 8;
    u64 *eight = group_slot.lookup(&at);
    if (!eight)
        return;
    u32 keyed_at = *slot / 8;
    take_slot(slot, *byte_of(eight, pgid), group_keyed.lookup(&keyed_at));
    u64 cgroup = bpf_get_current_cgroup_id();
    u8 *by_cgroup = cgroup_slot.lookup(&cgroup);
    keyed_at = *slot / 8;
    take_slot(slot, by_cgroup ? *by_cgroup : 0, cgroup_keyed.lookup(&keyed_at));
}
#endif

/* The cpu-clock tick: learn the slot of whoever runs now, which may have been
 * running since before the programs were loaded, been given (or lost) a slot
 * by userspace since it was switched in, or been switched in unseen. Only an
 * unseen slice's time so far is credited here (late); otherwise the runtime
 * is brought up to date at the switch out, and userspace counts a running
 * slice up to each sample. */
int on_tick(struct bpf_perf_event_data *ctx)
{
    struct cpu_run *run = this_cpu_run();
    if (!run)
        return 0;
    void *task = (void *)bpf_get_current_task();
#if defined(RING_LEN) && defined(RQ_FROM_TICK)
    learn_own_rq(task);
#endif
    u8 *slot = slot_of(bpf_get_current_pid_tgid() >> 32);
#ifdef SIGNAL_PGID_OFF
    if (slot)
        follow_rules(slot, current_task());
#endif
    u8 now_slot = slot ? *slot : 0;
    u8 unseen = run->task && run->task != (u64)task; /* switched in without the tracepoint */
    if (now_slot == run->slot && !unseen)
        return 0;
    u64 now = bpf_ktime_get_ns();
    void *me = current_task(); /* task, read through */
    u64 runtime = task_u64(me, TASK_RUNTIME_OFF, CURRENT_TYPED);
    ordered_add(&run->seq, 1);
    if (!unseen)
        credit(run, runtime, now); /* it left its group: what it ran as a member */
    /* Unseen: its slice up to now counts from its pick, as a switch would
     * have counted it; its runtime now is exact from here on (no cap). */
    if (unseen && now_slot)
        credit_late(now_slot, unseen_slice(me, runtime, CURRENT_TYPED));
    run->task = (u64)task;
    run->slot = now_slot;
    run->start = runtime;
    run->since = now;
    run->learnt = !unseen;
    ordered_add(&run->seq, 1);
    return 0;
}

/* args: (struct task_struct *parent, struct task_struct *child); current is the parent. */
RAW_TRACEPOINT_PROBE(sched_process_fork)
{
    u8 *parent = slot_of(bpf_get_current_pid_tgid() >> 32);
    if (!parent || !*parent)
        return 0;
    u8 group = *parent;
    void *child = (void *)ctx->args[1];
    u32 pid = 0, tgid = 0;
    bpf_probe_read_kernel(&pid, sizeof(pid), child + TASK_PID_OFF);
    bpf_probe_read_kernel(&tgid, sizeof(tgid), child + TASK_TGID_OFF);
    if (pid == 0 || pid != tgid) /* a new thread: its process already has a slot */
        return 0;
    u8 *slot = slot_of(pid);
    if (slot) {
        *slot = group;
    } else {
        u32 zero = 0;
        u64 *n = dropped_forks.lookup(&zero);
        if (n)
            *n += 1;
    }
    return 0;
}

/* args: (struct task_struct *p), which is current. Fires for every thread;
 * the process's last thread ends its membership (a main thread that exits
 * while workers run on leaves it a member): do_exit has counted the thread
 * out of signal->live before this tracepoint, so 0 there is the last one.
 * The pid cannot be reused before then (the leader is reaped after the last
 * thread). Its last slice is still credited at its last switch out:
 * cpu_run holds the slot. */
RAW_TRACEPOINT_PROBE(sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id, tgid = id >> 32;
#ifdef TASK_RUN_DELAY_OFF
    u64 *last = last_delay.lookup(&pid); /* a reused tid starts unseen */
    if (last)
        *last = 0;
#endif
    void *signal = 0;
    int live = 1;
    bpf_probe_read_kernel(&signal, sizeof(signal), (void *)ctx->args[0] + TASK_SIGNAL_OFF);
    if (signal)
        bpf_probe_read_kernel(&live, sizeof(live), signal + SIGNAL_LIVE_OFF);
    if (live > 0)
        return 0;
    u8 *slot = slot_of(tgid);
    if (slot)
        *slot = 0;
    return 0;
}

/* ---- Samples taken in the kernel ------------------------------------------
 *
 * on_sample fires at every sample boundary (a cpu-clock perf event on one
 * CPU, at the agent's --hz: an hrtimer, so a sample's time is the kernel's and
 * an agent that stalls loses none) and writes one sample into a ring the agent
 * maps and reads once a second: what userspace's SlotCounters.totals reads at
 * each of its samples, under the same sequence rules, and the machine's busy
 * and stolen time from the kernel's own per-CPU accounting (kernel_cpustat,
 * the counters /proc/stat prints).
 *
 * Defined only where the loader found what it needs (RING_LEN): the sampler
 * falls back to userspace's loop without it.
 *
 * `sample_config` is written by userspace: which slots to sample, in which
 * order (at most RING_SLOTS), and `gen`, odd while it is being written (a
 * sequence lock, as cpu_run's). Each sample records the gen it was taken
 * under; an odd one means the list was torn and the sample has no slots.
 *
 * kernel_cpustat is a per-CPU variable with no helper to reach it, and a
 * typed ksym would need the kernel's symbol table to hold data symbols
 * (CONFIG_KALLSYMS_ALL, which the CI host's kernel lacks). Every CPU's
 * `struct rq` is reachable from any task (se.cfs_rq->tg->cfs_rq[cpu]->rq)
 * where a task group's cfs_rq is an array of pointers, one per CPU (to 7.1);
 * where it is one per-CPU pointer (7.2), each CPU's tick learns its own
 * (learn_own_rq, RQ_FROM_TICK). Per-CPU variables keep their layout in every
 * CPU's copy: kernel_cpustat.cpustat lies KCPUSTAT_FROM_RQ bytes from runqueues
 * (their offsets in the kernel BTF's .data..percpu section). Each CPU's rq is
 * found once and checked (rq->cpu), then kept in `cpu_rq`.
 */
#ifdef RING_LEN
struct sample_config {
    u32 gen;
    u32 count;
    u8 slot[RING_SLOTS];   /* position -> slot */
    u8 position[MAX_SLOTS]; /* slot -> position + 1 (0: not sampled) */
};
BPF_F_TABLE("array", u32, struct sample_config, sample_config, 1, BPF_F_MMAPABLE);

struct sample_head {
    u64 written; /* samples written, ever: sample n is at n % RING_LEN */
    /* Why a CPU's run queue was not found, by the step that failed (task's
     * cfs_rq, its group, the group's per-CPU array, the CPU's cfs_rq, its rq,
     * rq.cpu), and kernel_cpustat reads that failed: the agent's reason. */
    u64 no_rq[6];
    u64 no_stat;
};
BPF_F_TABLE("array", u32, struct sample_head, sample_head, 1, BPF_F_MMAPABLE);

struct sample_time {
    u64 at;    /* CLOCK_MONOTONIC ns */
    u64 busy;  /* every CPU's user + nice + system + irq + softirq ns */
    u64 steal; /* every CPU's stolen ns */
    u32 gen;   /* sample_config's gen when taken; odd: no slots */
    u32 cpus;  /* the CPUs whose time it holds */
};
BPF_F_TABLE("array", u32, struct sample_time, sample_time, RING_LEN, BPF_F_MMAPABLE);
/* [position][sample]: a slot's samples together, so a reader of a few slots
 * maps the pages of those alone. The totals, as slot_ns's (ns, late). */
/* [position]: a slot's samples together (a column), so a reader of a few
 * slots maps the pages of those alone. The totals, as slot_ns's (ns, late). */
struct sample_column {
    struct slot_time t[RING_LEN];
};
BPF_F_TABLE("array", u32, struct sample_column, sample_slots, RING_SLOTS, BPF_F_MMAPABLE);
/* The sample being summed, before it goes into the columns: one element per CPU */
struct sample_sums {
    struct slot_time t[RING_SLOTS];
    u64 fence; /* what on_sample's fences exchange with */
};
BPF_PERCPU_ARRAY(sample_sums, struct sample_sums, 1);
static __always_inline u64 rq_of(u32 cpu, void *task, struct sample_head *head)
{
    u64 *known = cpu_rq.lookup(&cpu);
    if (!known)
        return 0;
    if (*known)
        return *known;
#ifdef RQ_FROM_TICK
    head->no_rq[3] += 1; /* its tick has not run yet (or never will: no tick there) */
    return 0;
#else
    void *cfs_rq = (void *)read_u64(task + TASK_CFS_RQ_OFF);
    if (!cfs_rq) {
        head->no_rq[0] += 1;
        return 0;
    }
    void *tg = (void *)read_u64(cfs_rq + CFS_RQ_TG_OFF);
    if (!tg) {
        head->no_rq[1] += 1;
        return 0;
    }
    void *per_cpu = (void *)read_u64(tg + TG_CFS_RQ_OFF);
    if (!per_cpu) {
        head->no_rq[2] += 1;
        return 0;
    }
    void *its_cfs_rq = (void *)read_u64(per_cpu + (u64)cpu * 8);
    if (!its_cfs_rq) {
        head->no_rq[3] += 1;
        return 0;
    }
    u64 rq = read_u64(its_cfs_rq + CFS_RQ_RQ_OFF);
    if (!rq) {
        head->no_rq[4] += 1;
        return 0;
    }
    if (read_u32((void *)rq + RQ_CPU_OFF) != cpu) {
        head->no_rq[5] += 1;
        return 0;
    }
    *known = rq;
    return rq;
#endif
}

int on_sample(struct bpf_perf_event_data *ctx)
{
    u32 zero = 0;
    struct sample_head *head = sample_head.lookup(&zero);
    struct sample_config *config = sample_config.lookup(&zero);
    struct sample_sums *sums = sample_sums.lookup(&zero);
    if (!head || !config || !sums)
        return 0;
    u64 n = head->written;
    u32 e = n & (RING_LEN - 1);
    struct sample_time *when = sample_time.lookup(&e);
    if (!when)
        return 0;
    u32 gen = config->gen;
    fence(&sums->fence); /* the gen read before the list it guards */
    __builtin_memset(sums->t, 0, sizeof(sums->t));
    u64 now = bpf_ktime_get_ns();
    void *task = (void *)bpf_get_current_task();
    u64 busy = 0, steal = 0;
    u32 cpus = 0;
    /* A loop counter never has its address taken (a lookup's key is a copy):
     * the verifiers of 6.1 and 6.12 lose a counter spilled to the stack, and
     * call the loop infinite. */
    for (u32 cpu = 0; cpu < NR_CPUS; cpu++) {
        u32 key = cpu;
        struct cpu_run *run = cpu_run.lookup(&key);
        struct slot_row *row = slot_ns.lookup(&key);
        if (!run || !row)
            break;
        asm volatile("" : "+r"(row)); /* as in this_cpu_slot */
        u64 seq = run->seq;
        fence(&sums->fence);
        u32 running = run->slot;
        u64 since = run->since;
        /* The count is read afresh at each use: a copy the exits had narrowed
         * would keep the verifier from merging the paths after them (it
         * refused the program beyond 8 CPUs). */
        for (u32 j = 0; j < RING_SLOTS && j < config->count; j++) {
            u32 k = j;
            asm volatile("" : "+r"(k)); /* indexed through the mask, not the loop's own (unrolled) counter */
            k &= RING_SLOTS - 1;
            struct slot_time *credited = &row->t[config->slot[k]];
            sums->t[k].ns += credited->ns;
            sums->t[k].late += credited->late;
        }
        fence(&sums->fence); /* the entry and the totals read before seq again */
        /* A CPU mid-switch (odd, or moved) is left out of the running slices, as userspace leaves it. */
        if (running && !(seq & 1) && seq == run->seq && now > since) {
            u32 j = config->position[running & (MAX_SLOTS - 1)];
            if (j && j <= config->count && j <= RING_SLOTS)
                sums->t[(j - 1) & (RING_SLOTS - 1)].ns += now - since;
        }
        u64 rq = rq_of(key, task, head);
        if (!rq)
            continue;
        u64 stat[KCPUSTAT_FIELDS] = {};
        if (bpf_probe_read_kernel(stat, sizeof(stat), (void *)(rq + KCPUSTAT_FROM_RQ))) {
            head->no_stat += 1;
            continue;
        }
        busy += stat[STAT_USER] + stat[STAT_NICE] + stat[STAT_SYSTEM] + stat[STAT_IRQ] + stat[STAT_SOFTIRQ];
        steal += stat[STAT_STEAL];
        cpus += 1;
    }
    u32 at = e;
    asm volatile("" : "+r"(at)); /* the mask below reaches the verifier: e was spilled, its bound lost */
    at &= RING_LEN - 1;
    for (u32 j = 0; j < RING_SLOTS; j++) {
        if (j >= config->count)
            break;
        u32 key = j;
        struct sample_column *column = sample_slots.lookup(&key);
        if (!column)
            break;
        asm volatile("" : "+r"(column)); /* as in this_cpu_slot */
        u32 k = j;
        asm volatile("" : "+r"(k)); /* the mask below reaches the verifier, whatever it makes of j */
        column->t[at] = sums->t[k & (RING_SLOTS - 1)];
    }
    fence(&sums->fence); /* the list read before the gen again */
    if (gen != config->gen)
        gen |= 1; /* the list changed while it was read */
    when->at = now;
    when->busy = busy;
    when->steal = steal;
    when->gen = gen;
    when->cpus = cpus;
    ordered_add(&head->written, 1); /* the count after the sample it counts */
    return 0;
}
#endif
