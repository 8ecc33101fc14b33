"""nodesampler: how busy each machine of an inference fleet is, and which engine makes it so."""

__version__ = "0.1.0"
