/*
 * sched_groups.bpf.c: on-CPU nanoseconds per watched process group.
 * Loaded by sampler/bpf_sched.py (bcc), which sets the constants below as
 * -D cflags and fills `task_slot` with the watched groups' processes.
 *
 * Each CPU keeps the time it last credited. Whenever the CPU switches task,
 * and at every tick of a per-CPU cpu-clock perf event, the time since then is
 * credited to the task that was running: to its group's slot, if it has one.
 * The ticks keep a task that never switches out (a busy loop on an idle CPU)
 * credited as it runs rather than in one lump when it stops.
 *
 * Membership lives in the kernel: a process forked by a member joins its
 * parent's slot at fork, so it counts from its first slice even if it exits
 * before userspace could ever see it. Its entry goes when it exits, so the
 * map holds live processes only, and a reused pid starts with no slot.
 *
 * No kernel struct is read through the compile-time headers (they may not be
 * the running kernel's): the running task comes from helpers, and the forked
 * child's pid and tgid from offsets that the loader read from the running
 * kernel's BTF (TASK_PID_OFF, TASK_TGID_OFF).
 */

#ifndef MAX_TASKS
#define MAX_TASKS 65536
#endif
#ifndef MAX_SLOTS
#define MAX_SLOTS 256
#endif

/* tgid -> slot of its group. Looked up on every switch; written only at fork,
 * exit and by userspace. */
BPF_HASH(task_slot, u32, u32, MAX_TASKS);
/* slot -> on-CPU ns, per CPU, cumulative: never cleared, userspace takes deltas. */
BPF_PERCPU_ARRAY(slot_ns, u64, MAX_SLOTS);
/* The time each CPU last credited. */
BPF_PERCPU_ARRAY(last_credit, u64, 1);
/* Forked children that found task_slot full: not counted, and userspace says so. */
BPF_PERCPU_ARRAY(dropped_forks, u64, 1);

/* Credit the time since this CPU's last credit to the current task's group. */
static __always_inline void credit_current(void)
{
    u32 zero = 0;
    u64 now = bpf_ktime_get_ns();
    u64 *last = last_credit.lookup(&zero);
    if (!last)
        return;
    u64 delta = *last ? now - *last : 0; /* the first event only starts the clock */
    *last = now;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (tgid == 0 || delta == 0) /* the idle task */
        return;
    u32 *slot = task_slot.lookup(&tgid);
    if (!slot)
        return;
    u64 *ns = slot_ns.lookup(slot);
    if (ns)
        *ns += delta; /* this CPU's own entry: no atomics needed */
}

/* The scheduler switches away from the current task (prev == current here). */
RAW_TRACEPOINT_PROBE(sched_switch)
{
    credit_current();
    return 0;
}

/* The perf event's tick: credit whoever is running now. */
int on_tick(struct bpf_perf_event_data *ctx)
{
    credit_current();
    return 0;
}

/* args: (struct task_struct *parent, struct task_struct *child); current is the parent. */
RAW_TRACEPOINT_PROBE(sched_process_fork)
{
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    u32 *slot = task_slot.lookup(&parent);
    if (!slot)
        return 0;
    u32 group = *slot;
    void *child = (void *)ctx->args[1];
    u32 pid = 0, tgid = 0;
    bpf_probe_read_kernel(&pid, sizeof(pid), child + TASK_PID_OFF);
    bpf_probe_read_kernel(&tgid, sizeof(tgid), child + TASK_TGID_OFF);
    if (pid == 0 || pid != tgid) /* a new thread: its process already has a slot */
        return 0;
    if (task_slot.insert(&pid, &group) != 0) {
        u32 zero = 0;
        u64 *n = dropped_forks.lookup(&zero);
        if (n)
            *n += 1;
    }
    return 0;
}

/* args: (struct task_struct *p), which is current. Fires for every thread. */
RAW_TRACEPOINT_PROBE(sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id, tgid = id >> 32;
    if (pid == tgid) { /* the process's main thread: the process is ending */
        credit_current(); /* its last slice, before the entry goes */
        task_slot.delete(&tgid);
    }
    return 0;
}
