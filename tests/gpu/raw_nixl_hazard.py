"""Raw NIXL's write through its descriptor of a freed VRAM buffer, through NIXL's own calls
(what gpupin's leases stand between).  Run by tests/gpu/test_nixl.py in a process of its
own: besides reporting DONE with the data elsewhere, such a write may crash the process
that makes it.  Prints one JSON line: NIXL's final state and how many bytes landed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nixl_target import MiB, RemoteBufferOf, Target  # noqa: E402

from gpupin.cuda import CudaMemory  # noqa: E402
from gpupin.nixl import NixlEndpoint  # noqa: E402


def main() -> int:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    cuda = CudaMemory()
    target = Target("cuda")
    ep = NixlEndpoint("initiator", cuda, mem_type="VRAM", auto_progress=True)
    ep.connect(target.metadata)
    target.call("connect", ep.metadata())
    dst = target.call("alloc", MiB)
    src = cuda.alloc(MiB)
    cuda.write(src, b"\x5a" * MiB)
    for _ in range(8):  # cuMemAlloc hands a freed address back, mostly at once
        rb = RemoteBufferOf(target, dst, MiB)
        ep.write(src, MiB, rb)  # connected, and the registration loaded at the initiator
        target.call("unexpose", rb.to_bytes())  # the target's registration stays cached, idle
        target.call("free", dst)
        again = target.call("alloc", MiB)
        if again == dst:
            break
        dst = again
    else:
        print("cuMemAlloc never handed the freed address back", file=sys.stderr)
        return 3
    target.call("fill", dst, MiB, 0)
    cuda.write(src, b"\xa5" * MiB)
    agent = ep.agent
    with ep.cache.acquire(src, MiB):
        local = agent.get_xfer_descs([(src, MiB, ep.driver.devid)], "VRAM")
        remote = agent.get_xfer_descs([(dst, MiB, rb.devid)], "VRAM")
        h = agent.initialize_xfer("WRITE", local, remote, "target", b"")
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        agent.release_xfer_handle(h)
    landed = target.call("read", dst, MiB).count(0xA5)
    print(json.dumps({"state": state, "landed": landed}), flush=True)
    target.call("free", dst)
    cuda.free(src)
    ep.close()
    target.close()
    cuda.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
