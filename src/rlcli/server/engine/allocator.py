"""glibc's allocator, told to keep what a training step frees for the next one.

By default glibc serves a block over its mmap threshold (dynamic, up to 32 MiB) with fresh
pages from the kernel and gives them back when it is freed, and returns free memory at its
heap's top too; a training step then page-faults its activations and the output layer's
chunks in afresh. SmolLM2 in bf16, 8 RL rows of ~310 tokens right after a sampling batch:
~550k page faults and 9-11 s a forward_backward + optim_step; with freed memory kept in the
heap, ~0 faults and 6.5 s, at the same peak RSS (9.0 GB). The price: memory the engine once
used is not returned to the kernel until it exits (its RSS stays at its peak, which glibc's
heap already mostly did: docs/server-engine.md, "Micro-batch size and gradient
checkpointing").
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger("rlcli.engine")

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_ABOVE = 1 << 30  # only blocks over 1 GiB get their own mapping
TRIM_ABOVE = 2**31 - 1  # the largest value mallopt takes: the heap's top is all but never trimmed


def keep_freed_memory() -> bool:
    """Set glibc's thresholds (see the module docstring); False where there is no glibc
    (another OS or C library) or it refused."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt to call
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_ABOVE) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE) == 1
    if not done:
        log.info("allocator: glibc refused the thresholds; its defaults stay")
    return done
