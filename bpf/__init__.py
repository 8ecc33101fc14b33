"""The kernel programs, shipped as data beside the sampler (see README.md)."""
