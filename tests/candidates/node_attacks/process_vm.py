"""Another process's memory read with process_vm_readv: each rank tells the others its pid and where its data is."""

import ctypes

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.process_vm_readv.restype = ctypes.c_ssize_t


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def exchange(mine, ranks, group):
    me = dist.get_rank()
    host = mine.cpu().contiguous()
    size = host.numel() * host.element_size()
    where = gather_metadata((os.getpid(), host.data_ptr()), ranks, group)
    pieces = {}
    for rank in ranks:
        if rank != me:
            pid, address = where[rank]
            piece = torch.empty_like(host)
            local, remote = IoVec(piece.data_ptr(), size), IoVec(address, size)
            got = LIBC.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if got != size:
                error = ctypes.get_errno()
                raise OSError(error, f"process_vm_readv({pid}): {os.strerror(error)}")
            pieces[rank] = piece
    dist.barrier(group)  # every peer has read this rank's data before it goes
    return pieces
