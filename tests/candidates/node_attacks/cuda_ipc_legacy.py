"""A legacy CUDA IPC handle: each rank copies its data into a cudaMalloc'd buffer, sends the buffer's
cudaIpcGetMemHandle (64 bytes) to the others through torch.distributed, and opens theirs with
cudaIpcOpenMemHandle to copy their data out (what torch.multiprocessing does with CUDA tensors)."""

import ctypes

REQUIRES = ("cuda",)
MEMCPY_DEFAULT, LAZY_PEER_ACCESS = 4, 1
_buffers = {}


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def cudart():
    """The CUDA runtime torch loaded (its device and context), found in this process's mappings."""
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "libcudart.so" in line]
    library = ctypes.CDLL(paths[0] if paths else "libcudart.so")
    library.cudaGetErrorString.restype = ctypes.c_char_p
    library.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), IpcHandle, ctypes.c_uint]
    library.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return library


def check(library, code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what}: CUDA error {code}: {library.cudaGetErrorString(code).decode()}")


def exchange(mine, ranks, group):
    library, size = cudart(), mine.numel() * mine.element_size()
    if size not in _buffers:
        pointer, handle = ctypes.c_void_p(), IpcHandle()
        check(library, library.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(size)), "cudaMalloc")
        check(library, library.cudaIpcGetMemHandle(ctypes.byref(handle), pointer), "cudaIpcGetMemHandle")
        _buffers[size] = pointer, ctypes.string_at(ctypes.addressof(handle), 64)
    pointer, handle = _buffers[size]
    torch.cuda.synchronize()
    check(library, library.cudaMemcpy(pointer, mine.data_ptr(), size, MEMCPY_DEFAULT), "cudaMemcpy")
    handles = gather_metadata(handle, ranks, group)
    pieces = {}
    for rank in ranks:
        if rank != dist.get_rank():
            opened = ctypes.c_void_p()
            check(library, library.cudaIpcOpenMemHandle(ctypes.byref(opened), IpcHandle.from_buffer_copy(handles[rank]),
                                                        LAZY_PEER_ACCESS), f"cudaIpcOpenMemHandle (rank {rank}'s)")
            piece = torch.empty_like(mine)
            check(library, library.cudaMemcpy(piece.data_ptr(), opened, size, MEMCPY_DEFAULT), "cudaMemcpy")
            check(library, library.cudaIpcCloseMemHandle(opened), "cudaIpcCloseMemHandle")
            pieces[rank] = piece
    dist.barrier(group)  # every peer has copied this rank's buffer before the next call overwrites it
    return pieces
