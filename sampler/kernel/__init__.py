"""The kernel backend: BPF programs that count each shard's on-CPU time in
the kernel. `btf` finds what the kernel's types say; `handoff` runs the
loader child (`loader_child`, where bcc's compiler lives and dies) and takes
the programs' descriptors from it; `libbpf` and `tp_btf` speak to the kernel
without bcc; `sched` is the backend the agent samples through."""
