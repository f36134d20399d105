"""Probe CUDA pointer-attribute facts on a GPU machine (VMM ranges, mapping attributes)."""

from cuda.bindings import driver as cu


def ok(r):
    while isinstance(r, tuple) and len(r) == 1 and isinstance(r[0], tuple):
        r = r[0]
    err = r[0] if isinstance(r, tuple) else r
    assert int(err) == 0, err
    if not isinstance(r, tuple) or len(r) == 1:
        return None
    return r[1] if len(r) == 2 else r[1:]


ok(cu.cuInit(0))
dev = ok(cu.cuDeviceGet(0))
ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
ok(cu.cuCtxSetCurrent(ctx))
P = cu.CUpointer_attribute
prop = cu.CUmemAllocationProp()
prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
minimum = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
gran = int(ok(cu.cuMemGetAllocationGranularity(prop, minimum)))
chunk = max(gran, 2 << 20)
base = int(ok(cu.cuMemAddressReserve(2 * chunk, 0, 0, 0)))
hs = []
for i in range(2):
    h = ok(cu.cuMemCreate(chunk, prop, 0))
    ok(cu.cuMemMap(base + i * chunk, chunk, 0, h, 0))
    a = cu.CUmemAccessDesc()
    a.location = prop.location
    a.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    ok(cu.cuMemSetAccess(base + i * chunk, chunk, [a], 1))
    hs.append(h)
names = [n for n in dir(P) if n.startswith("CU_POINTER_ATTRIBUTE_")]
from gpupin._native import ffi, lib  # noqa: E402

assert lib.gp_cuda_open(int(P.CU_POINTER_ATTRIBUTE_BUFFER_ID)) == 0
plain = int(ok(cu.cuMemAlloc(4 << 20)))
print("chunk", hex(chunk), "base", hex(base))
for i, p in enumerate((base + 4096, base + chunk + 4096, plain + 4096)):
    for n in (
        "RANGE_START_ADDR",
        "RANGE_SIZE",
        "BUFFER_ID",
        "MAPPING_SIZE",
        "MAPPING_BASE_ADDR",
        "IS_MANAGED",
        "MEMORY_TYPE",
        "MEMPOOL_HANDLE",
    ):
        full = "CU_POINTER_ATTRIBUTE_" + n
        if full not in names:
            print(i, n, "absent")
            continue
        out = ffi.new("uint64_t *")
        err = lib.gp_cuda_attr_u64(p, int(getattr(P, full)), out)
        print(i, n, hex(out[0]) if err == 0 else f"error {err}")
