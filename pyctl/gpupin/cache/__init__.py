"""A lazy-unpinning registration cache (pin-down cache) over a gpupin Device.

The GPUDirect RDMA recipe, made cheap: on first use pin the whole allocation
that holds a buffer and remember its buffer id; on every use validate the
entry (the kernel's validity word, the provider's buffer id, or both) and pin
again if it went stale; unpin lazily, least recently used first, when a limit
is reached or the GPU runs out of BAR space.  Entries in use are never
evicted.  One entry per allocation: buffer ids are per allocation, so entries
never merge across allocations.

A hit is one call into C, the fast path (``fast_lookup``, and ``lookup``
first): find the entry, read its validity word (and query the buffer id
through the provider's query in C: libcuda's for CudaMemory, an ioctl for
SimMemory), take a reference, all without the cache's lock.  What it cannot
settle goes to the slow path (``miss``), in Python under the lock: misses,
eviction and invalidation, and buffer ids a provider cannot check in C.

Lifetimes (Documentation/python.md's "Lifetime rules" says the same for users):

- A token (what ``lookup``/``fast_lookup`` return) names one entry: the C core
  gives every entry a new generation, checked on every use, so a late or
  doubled ``release_token`` after its slot was reused is refused, never
  applied to another entry.  A slot is reused only once nobody holds it.
  Generations never wrap: after 2**30 - 1 entries a cache raises
  CacheExhausted at its next insert (a hard error, not a wrap; make a new cache).
- ``close()`` refuses (InUse) while a registration is held; ``Device.close()``
  too for the caches over it.  Released first, everything is unpinned.
- A cache dropped without ``close()`` is closed by its finalizer: its core
  stops reading the validity map (bound fast paths then raise), and every pin
  nobody holds is unpinned.  Pins still held through bare tokens stay until
  the device closes.
- In a fork child the cache starts empty and opens a device of its own at its
  first pin; the parent's registrations are the parent's (releasing a parent's
  Registration in the child does nothing, a parent's token is refused).  A
  closed cache stays closed.

The package, a module per role:

- protocols.py: what the cache asks of a device, a memory provider and a pin,
  and what it reads, once, of what they may offer beyond that;
- _state.py: what every part of a cache shares; _registration.py: what a use
  holds; _records.py: a device's invalidation records, routed to its caches;
- _core.py: the C core's lifetime, and the fast path's calls into it;
- _policy.py: insertion, eviction and invalidation;
- _life.py: close and fork;
- _hits.py: the hit paths;
- _cache.py: RegistrationCache, built on the parts above;
- library.py: the base of the devices that register memory with another
  library (cuFile, NIXL).
"""

from __future__ import annotations

# What fast_lookup is bound to reads this name here: set to None, caches made after run the
# cffi calls instead of the vectorcall entry points (tests cover both that way).
from .._native import gpc_bind as gpc_bind
from ._cache import RegistrationCache
from ._policy import CacheFull
from ._registration import Registration
from ._state import Backend, CacheStats, Validate
from .library import LibraryDriver, LibraryRegistration
from .protocols import GPU_PAGE, DeviceLike

__all__ = [
    "GPU_PAGE",
    "Backend",
    "CacheFull",
    "CacheStats",
    "DeviceLike",
    "LibraryDriver",
    "LibraryRegistration",
    "Registration",
    "RegistrationCache",
    "Validate",
]
