"""The kernel backend: BPF programs that count each shard's on-CPU time in
the kernel. A file a job:

- `sched`: the backend the agent samples through (`load`, `KernelShardSampler`):
  shards to slots, and a sample's seconds of each shard;
- `membership`: the kernel's map of which process counts for which slot;
- `counters`: each CPU's counters by slot, read at every sample;
- `slices`: what a sample may be credited of the slices the kernel counted;
- `waits`: waits for a CPU, from the kernel's histograms;
- `build`: the programs compiled and attached, in the loader child
  (`loader_child`, where bcc's compiler lives and dies), with `capabilities`,
  `headers` (what bcc compiles against) and `btf` (what the kernel's types say);
- `handoff`: runs the loader child and takes the programs' descriptors from it;
- `libbpf`, `tp_btf`: the `bpf()` system call without bcc;
- `program_stats`: the programs' own cost, as the kernel counts it.
"""
