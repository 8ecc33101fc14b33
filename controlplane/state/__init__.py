"""The fleet as the control plane knows it: the registry, what of it survives a
restart (registry_state), and each shard's starvation verdict."""
