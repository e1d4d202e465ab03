"""A demo server that holds real GPU memory: for tools/gpu-check.sh, on an NVIDIA host.

Allocates ``--mb`` MiB on the first GPU it can see (through the CUDA driver API, by
ctypes: no CUDA toolkit or Python package needed), then runs slotctl's demo server with
the arguments after ``--``. The controller decides which GPU that is (it sets
``CUDA_VISIBLE_DEVICES``), so ``nvidia-smi --query-compute-apps`` shows where the slot
really runs.

    python tools/gpu_ballast.py --mb 512 -- --host 127.0.0.1 --port 18090 --model m
"""

from __future__ import annotations

import ctypes
import runpy
import sys


def hold(mb: int) -> object:
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(what: str, status: int) -> None:
        if status != 0:
            sys.exit(f"gpu_ballast: {what} failed with CUDA error {status}")

    check("cuInit", cuda.cuInit(0))
    device = ctypes.c_int()
    check("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(device), 0))
    context = ctypes.c_void_p()
    check("cuCtxCreate", cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device))
    pointer = ctypes.c_uint64()
    check("cuMemAlloc", cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(mb << 20)))
    return (cuda, context, pointer)  # kept alive for the life of the process


def main() -> None:
    args = sys.argv[1:]
    split = args.index("--") if "--" in args else len(args)
    mb = int(args[args.index("--mb") + 1]) if "--mb" in args[:split] else 256
    keep = hold(mb)
    sys.argv = ["controller.demo", *args[split + 1 :]]
    try:
        runpy.run_module("controller.demo", run_name="__main__", alter_sys=True)
    finally:
        del keep


if __name__ == "__main__":
    main()
