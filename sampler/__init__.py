"""The node agent: the kernel (BPF) and /proc backends, the machine's and the
engines' readings, GPUs through NVML, window summaries, and the heartbeat client."""
