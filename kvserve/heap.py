"""Handing the heap's free memory back to the operating system.

glibc keeps memory freed by a burst of large steps (activations, logits, tier copies) in its arenas, so a
server's resident size stays at its busiest moment's long after the burst. ``malloc_trim`` returns the free
pages of every arena; the engine calls it once each time it goes idle, where it delays nothing but a
request that arrives during those milliseconds.
"""

from __future__ import annotations

import ctypes


def release_free_heap() -> bool:
    """Return the free pages of the C heap to the OS; False where the C library has no ``malloc_trim``
    (not glibc), where this does nothing."""
    try:
        # The process's own symbols, libc's among them: no library search (find_library runs ldconfig).
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
