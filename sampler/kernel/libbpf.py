"""libbpf, the C library bcc is built on (a few hundred KiB), through ctypes:
what the agent reads the kernel programs' maps with once they run, without
bcc's compiler in the process (sampler/kernel/handoff.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sampler.backend_unavailable import BackendUnavailable


@dataclass
class BpfMap:
    """One map of the loaded programs, read by its descriptor through libbpf."""

    name: str
    fd: int
    value_size: int  # one CPU's value for a per-CPU map
    percpu: bool
    _lib: Any = field(default=None, repr=False)
    _key: ctypes.c_uint32 = field(default_factory=ctypes.c_uint32, repr=False)
    _value: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._lib = libbpf()
        cpus = self._lib.libbpf_num_possible_cpus() if self.percpu else 1
        # The kernel lays per-CPU values out at 8-byte strides, one per possible CPU.
        stride = (self.value_size + 7) // 8 * 8 if self.percpu else self.value_size
        self._value = ctypes.create_string_buffer(stride * cpus)

    def lookup(self, key: int) -> bytes:
        """The value at an array index (every CPU's, for a per-CPU map)."""
        self._key.value = key
        if self._lib.bpf_map_lookup_elem(self.fd, ctypes.byref(self._key), self._value) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"reading {self.name}[{key}]: {os.strerror(err)}")
        return bytes(self._value.raw)

    def update(self, key: bytes, value: bytes) -> None:
        """Writes one entry (a hash map's key, as the map lays it out)."""
        if self._lib.bpf_map_update_elem(self.fd, key, value, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"writing {self.name}: {os.strerror(err)}")

    def delete(self, key: bytes) -> None:
        """Removes one entry; one already absent is no error."""
        if self._lib.bpf_map_delete_elem(self.fd, key) != 0 and (err := ctypes.get_errno()) != errno.ENOENT:
            raise OSError(err, f"deleting from {self.name}: {os.strerror(err)}")

    def take_all(self, max_entries: int) -> tuple[np.ndarray, bytes]:
        """Every entry of a hash map with u32 keys, read and deleted in
        batches (one system call each, BPF_MAP_LOOKUP_AND_DELETE_BATCH, 5.6+):
        the keys, and the values laid end to end."""
        keys = np.empty(max_entries, dtype=np.uint32)
        values = ctypes.create_string_buffer(self.value_size * max_entries)
        count = ctypes.c_uint32()
        batch_in, batch_out = ctypes.c_uint64(), ctypes.c_uint64()  # the kernel's place in the map between calls
        got_keys, got_values = [], []
        first = True
        while True:
            count.value = max_entries
            rc = self._lib.bpf_map_lookup_and_delete_batch(
                self.fd, None if first else ctypes.byref(batch_in), ctypes.byref(batch_out),
                keys.ctypes.data, values, ctypes.byref(count), None)  # fmt: skip
            err = ctypes.get_errno() if rc != 0 else 0
            if rc != 0 and err != errno.ENOENT:
                raise OSError(err, f"taking {self.name}: {os.strerror(err)}")
            got_keys.append(keys[: count.value].copy())
            got_values.append(values.raw[: count.value * self.value_size])
            if rc != 0:  # ENOENT: the map's end reached
                return np.concatenate(got_keys), b"".join(got_values)
            batch_in.value, first = batch_out.value, False


_libbpf: Any = None


def libbpf() -> Any:
    """libbpf, as bcc's own packages bring it (Debian's libbpf1)."""
    global _libbpf
    if _libbpf is None:
        name = ctypes.util.find_library("bpf") or "libbpf.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as e:
            raise BackendUnavailable(f"libbpf is not installed ({e}); install libbpf1") from None
        lib.bpf_map_lookup_elem.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.bpf_map_lookup_elem.restype = ctypes.c_int
        lib.libbpf_num_possible_cpus.restype = ctypes.c_int
        lib.bpf_map_lookup_and_delete_batch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                        ctypes.c_void_p]  # fmt: skip
        lib.bpf_map_lookup_and_delete_batch.restype = ctypes.c_int
        lib.bpf_map_update_elem.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint64]
        lib.bpf_map_update_elem.restype = ctypes.c_int
        lib.bpf_map_delete_elem.argtypes = [ctypes.c_int, ctypes.c_char_p]
        lib.bpf_map_delete_elem.restype = ctypes.c_int
        _libbpf = lib
    return _libbpf
