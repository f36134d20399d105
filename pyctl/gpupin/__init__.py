"""gpupin: pin NVIDIA GPU memory for third-party devices.

``Device`` wraps /dev/gpupin (gpupin.ko); ``SimMemory`` (here) and
``gpupin.cuda.CudaMemory`` provide device memory; ``gpupin.kmod`` (imported on
its own) loads the modules.
"""

from __future__ import annotations

from .device import ABI_VERSION, GPU_PAGE_SIZE, Device, DmaMapping, Event, Info, Pin, PinState
from .errors import (
    AbiMismatch,
    BarExhausted,
    BudgetExceeded,
    CacheExhausted,
    DriverNotLoaded,
    EventsLost,
    ForkedDevice,
    GdsError,
    GpupinError,
    InUse,
    InvalidArgument,
    ModuleError,
    NotGpuMemory,
    NotRevocable,
    PermissionDenied,
    PinInvalidated,
    QuotaExceeded,
    TransferAborted,
    UnknownHandle,
)
from .memory import AllocationRange, MemoryProvider
from .sim import SimMemory, SimStats, sim_stats

__version__ = "0.1.0"

__all__ = [
    "ABI_VERSION",
    "GPU_PAGE_SIZE",
    "AbiMismatch",
    "AllocationRange",
    "BarExhausted",
    "BudgetExceeded",
    "QuotaExceeded",
    "Device",
    "DmaMapping",
    "DriverNotLoaded",
    "Event",
    "EventsLost",
    "ForkedDevice",
    "GdsError",
    "GpupinError",
    "CacheExhausted",
    "InUse",
    "Info",
    "InvalidArgument",
    "MemoryProvider",
    "ModuleError",
    "NotGpuMemory",
    "NotRevocable",
    "PermissionDenied",
    "Pin",
    "PinInvalidated",
    "PinState",
    "SimMemory",
    "SimStats",
    "TransferAborted",
    "UnknownHandle",
    "sim_stats",
]
