"""One side of a CUDA IPC exchange through the driver API (ctypes on libcuda):

  python3 cuda_ipc_probe.py export FILE   # allocate 1 MiB, fill 0x11, write the handle to FILE,
                                          # wait for FILE.done, check the importer wrote 0x22
  python3 cuda_ipc_probe.py import FILE   # open the handle, check 0x11, write 0x22, FILE.done

Each side prints one line and exits 0 on success. cuda_ipc_namespaces.sh runs
the two in different namespaces, users and MPS set-ups.
"""
import ctypes as C
import os
import sys
import time

cuda = C.CDLL("libcuda.so.1")
N = 1 << 20


class Handle(C.Structure):
    _fields_ = [("reserved", C.c_char * 64)]


def check(result, what):
    if result:
        name = C.c_char_p()
        cuda.cuGetErrorName(result, C.byref(name))
        raise RuntimeError("%s: %s" % (what, name.value.decode() if name.value else result))


def main(role, path):
    check(cuda.cuInit(0), "cuInit")
    dev, ctx, ptr = C.c_int(), C.c_void_p(), C.c_uint64()
    check(cuda.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
    check(cuda.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    host = (C.c_ubyte * N)()
    if role == "export":
        check(cuda.cuMemAlloc_v2(C.byref(ptr), C.c_size_t(N)), "cuMemAlloc")
        check(cuda.cuMemsetD8_v2(ptr, C.c_ubyte(0x11), C.c_size_t(N)), "cuMemsetD8")
        check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
        handle = Handle()
        check(cuda.cuIpcGetMemHandle(C.byref(handle), ptr), "cuIpcGetMemHandle")
        with open(path + ".tmp", "wb") as f:
            f.write(bytes(handle))
        os.rename(path + ".tmp", path)
        for _ in range(400):
            if os.path.exists(path + ".done"):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("no importer within 20 s")
        check(cuda.cuMemcpyDtoH_v2(host, ptr, C.c_size_t(N)), "cuMemcpyDtoH")
        with open(path + ".done") as f:
            verdict = f.read().strip()
        seen = "0x22 everywhere" if all(b == 0x22 for b in bytes(host)) else "unchanged"
        print("exporter pid %d: importer said %r; memory %s" % (os.getpid(), verdict, seen))
        return 0 if verdict == "ok" and seen.startswith("0x22") else 1
    with open(path, "rb") as f:
        handle = Handle.from_buffer_copy(f.read())
    cuda.cuIpcOpenMemHandle_v2.argtypes = [C.POINTER(C.c_uint64), Handle, C.c_uint]
    try:
        check(cuda.cuIpcOpenMemHandle_v2(C.byref(ptr), handle, 1), "cuIpcOpenMemHandle")
        check(cuda.cuMemcpyDtoH_v2(host, ptr, C.c_size_t(N)), "cuMemcpyDtoH")
        if not all(b == 0x11 for b in bytes(host)):
            raise RuntimeError("opened, but the exporter's bytes are not there")
        check(cuda.cuMemsetD8_v2(ptr, C.c_ubyte(0x22), C.c_size_t(N)), "cuMemsetD8")
        check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
        check(cuda.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")
        verdict = "ok"
    except RuntimeError as e:
        verdict = str(e)
    with open(path + ".done.tmp", "w") as f:
        f.write(verdict)
    os.rename(path + ".done.tmp", path + ".done")
    print("importer pid %d uid %d: %s" % (os.getpid(), os.getuid(), verdict))
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
