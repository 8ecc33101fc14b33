"""What the machine says of itself and of its processes: /proc (procfs), the
machine's figures (machine), the host seen from a container (host_view),
cgroups (cgroup_view, cfs), run-queue waits (runqueue) and CPU lists."""
