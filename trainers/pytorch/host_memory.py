"""trainer.release_host_memory: give freed tensor memory back to the operating system.

glibc's malloc keeps freed blocks below its mmap threshold for reuse, and raises that
threshold (up to 32 MiB) each time a large block is freed. FSDP on CPU allocates and frees
tens of MiB a block every step (gathered parameters, gradients before their reduce-scatter):
with the default, a worker's peak resident memory crept up step after step (measured with the
~101M-parameter example at 2 workers: 1263 -> 1651 MiB over 3 steps; with a fixed 1 MiB
threshold: 1279 and flat). Each new large block then costs page faults: ~30% more step time
there. On a GPU the tensors live in the device's caching allocator and this changes little.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger("orchestrator.worker")

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
THRESHOLD_BYTES = 1 << 20


def wanted(setting: bool | None, parallel: str, device_type: str) -> bool:
    """null: on for a sharded model trained on CPU (a job that shards for memory), else off."""
    if setting is not None:
        return setting
    return parallel == "fsdp" and device_type == "cpu"


def release_freed_memory() -> bool:
    """Blocks of 1 MiB and more get their own mapping, unmapped when freed (glibc only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES))
    except (OSError, AttributeError):  # musl and others: no mallopt
        log.warning("trainer.release_host_memory: this C library has no mallopt; ignored")
        return False
