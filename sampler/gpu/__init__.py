"""GPUs through NVML."""
