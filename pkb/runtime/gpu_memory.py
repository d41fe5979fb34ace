"""GPU memory as the driver counts it: each device's free memory and each process's use, read through NVML
(the driver's ``libnvidia-ml.so.1``, no Python package needed), and the processes of a rank group.

Evaluations side by side share the GPUs' memory (pkb.executor.local). What one needs is measured, never
guessed: the memory of every process of its rank groups, including what a candidate starts (a sandboxed
group's ranks live below its jail), summed per device.

    >>> reader = NvmlReader.open()          # None without a driver (a CPU machine)
    >>> reader.free_bytes()                 # {0: 148_000_000_000}
    >>> reader.used_by_process()            # {0: {4242: 600_000_000, ...}}
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

_SUCCESS, _INSUFFICIENT_SIZE = 0, 7
_NOT_AVAILABLE = 2**64 - 1  # usedGpuMemory where the driver cannot tell (NVML_VALUE_NOT_AVAILABLE)


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _ProcessInfo(ctypes.Structure):  # nvmlProcessInfo_t of the _v2 and _v3 calls
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                ("computeInstanceId", ctypes.c_uint)]


class NvmlReader:
    """Reads the driver's memory accounting; one per process (``open`` shares it), safe across threads."""

    _opened: "NvmlReader | None | bool" = False
    _open_lock = threading.Lock()

    def __init__(self, library: ctypes.CDLL):
        self._nvml = library
        self._lock = threading.Lock()
        count = ctypes.c_uint()
        self._call("nvmlDeviceGetCount_v2", ctypes.byref(count))
        self._devices = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            self._call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
            self._devices.append(handle)
        running = getattr(library, "nvmlDeviceGetComputeRunningProcesses_v3", None)
        self._running = running or library.nvmlDeviceGetComputeRunningProcesses_v2

    @classmethod
    def open(cls) -> "NvmlReader | None":
        """The reader, or None where there is no NVIDIA driver to ask."""
        with cls._open_lock:
            if cls._opened is False:
                try:
                    library = ctypes.CDLL("libnvidia-ml.so.1")
                    if library.nvmlInit_v2() != _SUCCESS:
                        raise OSError("nvmlInit_v2 failed")
                    cls._opened = cls(library)
                except (OSError, AttributeError, RuntimeError):
                    cls._opened = None
            return cls._opened

    def _call(self, name: str, *args) -> None:
        code = getattr(self._nvml, name)(*args)
        if code != _SUCCESS:
            raise RuntimeError(f"NVML {name} failed with code {code}")

    @property
    def num_devices(self) -> int:
        return len(self._devices)

    def free_bytes(self) -> dict[int, int]:
        """Free memory of each device (NVML's index), as the driver counts it now."""
        return {index: memory.free for index, memory in self._memory().items()}

    def total_bytes(self) -> dict[int, int]:
        return {index: memory.total for index, memory in self._memory().items()}

    def _memory(self) -> dict[int, _Memory]:
        with self._lock:
            found = {}
            for index, handle in enumerate(self._devices):
                found[index] = _Memory()
                self._call("nvmlDeviceGetMemoryInfo", handle, ctypes.byref(found[index]))
            return found

    def used_by_process(self) -> dict[int, dict[int, int]]:
        """Per device, the memory each process with a context there uses (processes whose use the driver
        cannot tell are left out)."""
        with self._lock:
            usage = {}
            for index, handle in enumerate(self._devices):
                count = ctypes.c_uint(64)
                while True:
                    infos = (_ProcessInfo * count.value)()
                    code = self._running(handle, ctypes.byref(count), infos)
                    if code == _INSUFFICIENT_SIZE:
                        count = ctypes.c_uint(count.value + 64)
                        continue
                    if code != _SUCCESS:
                        raise RuntimeError(f"NVML nvmlDeviceGetComputeRunningProcesses failed with code {code}")
                    break
                usage[index] = {info.pid: info.usedGpuMemory for info in infos[:count.value]
                                if info.usedGpuMemory != _NOT_AVAILABLE}
            return usage


@dataclass(frozen=True)
class Usage:
    """Memory per device (NVML's index) that one set of processes uses: ``{device: bytes}``."""

    by_device: dict[int, int]

    @property
    def largest(self) -> int:
        return max(self.by_device.values(), default=0)

    def merged(self, other: "Usage") -> "Usage":
        """The larger of the two on each device (a running peak)."""
        devices = self.by_device.keys() | other.by_device.keys()
        return Usage({d: max(self.by_device.get(d, 0), other.by_device.get(d, 0)) for d in devices})


def usage_of(pids: set[int], per_process: dict[int, dict[int, int]]) -> Usage:
    """What the processes ``pids`` use on each device."""
    return Usage({device: sum(used for pid, used in processes.items() if pid in pids)
                  for device, processes in per_process.items()})


GIB = float(1 << 30)
