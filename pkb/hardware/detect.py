"""What this machine is: GPU model and count, NVLink links per peer, P2P access, NVLS switches.

``detect()`` reads, in this order: torch (device names, count, peer access), NVML through the
``pynvml`` module of ``nvidia-ml-py`` if it is installed (NVLink links per peer), else the output of
``nvidia-smi topo -m``, else the links are unknown. ``choose_profile()`` then picks the profile the
roofline uses: the one ``pkb calibrate`` stored for this GPU model and count, else the datasheet
profile of the GPU model, else the ``cpu`` plumbing profile.

    >>> machine = detect()              # on a machine without GPUs
    >>> machine.num_gpus, choose_profile(machine).name
    (0, 'cpu')
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

from pkb.hardware.profiles import HardwareProfile, get_profile, profile_for_gpu

# Environment switches that keep NVLink multicast (NVLS) off; pkb never changes them.
NVLS_SWITCHES = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

LinkMatrix = tuple[tuple[int | None, ...], ...]  # [i][j]: NVLink links from GPU i to GPU j; None on the diagonal


@dataclass(frozen=True)
class MachineInfo:
    gpu_model: str | None  # torch.cuda.get_device_name(0); None without GPUs
    num_gpus: int
    gpu_names: tuple[str, ...] = ()
    nvlink_links: LinkMatrix | None = None  # None: unknown
    nvlink_source: str = "unknown"  # "nvml", "nvidia-smi topo -m" or "unknown"
    p2p_access: tuple[tuple[bool, ...], ...] = ()  # [i][j]: GPU i can access GPU j's memory
    nvls_env: dict[str, str | None] = field(default_factory=dict)  # the switches as set (None: unset)

    @property
    def nvls_disabled_by_env(self) -> bool:
        return any(self.nvls_env.get(name) == value for name, value in NVLS_SWITCHES.items())

    def to_dict(self) -> dict[str, Any]:
        row = asdict(self)
        row["nvls_disabled_by_env"] = self.nvls_disabled_by_env
        return row


def detect() -> MachineInfo:
    """This machine as torch, NVML (or nvidia-smi) and the environment describe it."""
    nvls_env = {name: os.environ.get(name) for name in NVLS_SWITCHES}
    names = _gpu_names()
    if not names:
        return MachineInfo(gpu_model=None, num_gpus=0, nvls_env=nvls_env)
    links, source = _nvlink_links(len(names))
    return MachineInfo(gpu_model=names[0], num_gpus=len(names), gpu_names=names, nvlink_links=links,
                       nvlink_source=source, p2p_access=_p2p_matrix(len(names)), nvls_env=nvls_env)


def choose_profile(machine: MachineInfo, calibrated: bool = True) -> HardwareProfile:
    """The calibrated profile stored for this machine (if ``calibrated``), else the datasheet profile
    of its GPU model, else the ``cpu`` profile."""
    if machine.num_gpus == 0 or machine.gpu_model is None:
        return get_profile("cpu")
    if calibrated:
        from pkb.hardware.stored import load_calibrated

        stored = load_calibrated(machine.gpu_model, machine.num_gpus)
        if stored is not None:
            return stored
    return profile_for_gpu(machine.gpu_model) or get_profile("cpu")


# -- torch ------------------------------------------------------------------------------------------


def _gpu_names() -> tuple[str, ...]:
    from pkb.runtime.modes import visible_gpu_count

    count = visible_gpu_count()
    if count == 0:
        return ()
    import torch

    return tuple(torch.cuda.get_device_name(i) for i in range(count))


def _p2p_matrix(num_gpus: int) -> tuple[tuple[bool, ...], ...]:
    import torch

    return tuple(tuple(i != j and bool(torch.cuda.can_device_access_peer(i, j)) for j in range(num_gpus))
                 for i in range(num_gpus))


def _pci_ids() -> list[tuple[int, int, int]]:
    """(domain, bus, device) of each CUDA device, in CUDA's order."""
    import torch

    ids = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        ids.append((getattr(props, "pci_domain_id", 0), getattr(props, "pci_bus_id", -1),
                    getattr(props, "pci_device_id", -1)))
    return ids


# -- NVLink links -----------------------------------------------------------------------------------


def _nvlink_links(num_gpus: int) -> tuple[LinkMatrix | None, str]:
    try:
        links = _links_from_nvml(num_gpus)
        if links is not None:
            return links, "nvml"
    except Exception:  # NVML missing or too old for a call: fall back to nvidia-smi
        pass
    try:
        links = _links_from_nvidia_smi(num_gpus)
        if links is not None:
            return links, "nvidia-smi topo -m"
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return None, "unknown"


def _links_from_nvml(num_gpus: int) -> LinkMatrix | None:
    """Active NVLink links per peer from NVML. Links that end at an NVSwitch (not at a GPU) reach
    every peer, so on NVSwitch systems each peer is counted with all of them (as ``topo -m`` does)."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        handles = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pci = pynvml.nvmlDeviceGetPciInfo(handle)
            handles[(pci.domain, pci.bus, pci.device)] = handle
        cuda_ids = _pci_ids()
        if len(cuda_ids) != num_gpus or any(key not in handles for key in cuda_ids):
            return None  # cannot tell which NVML device is which CUDA device
        max_links = getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)
        remote_pci = (getattr(pynvml, "nvmlDeviceGetNvLinkRemotePciInfo_v2", None)
                      or pynvml.nvmlDeviceGetNvLinkRemotePciInfo)  # nvidia-ml-py has only the latter
        rows = []
        for i, key in enumerate(cuda_ids):
            to_gpu = [0] * num_gpus
            to_switch = 0
            for link in range(max_links):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handles[key], link) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = remote_pci(handles[key], link)
                except pynvml.NVMLError:
                    continue
                peer = (remote.domain, remote.bus, remote.device)
                if peer in cuda_ids:
                    to_gpu[cuda_ids.index(peer)] += 1
                else:
                    to_switch += 1
            rows.append(tuple(None if j == i else to_gpu[j] + to_switch for j in range(num_gpus)))
        return tuple(rows)
    finally:
        pynvml.nvmlShutdown()


def _links_from_nvidia_smi(num_gpus: int) -> LinkMatrix | None:
    if shutil.which("nvidia-smi") is None:
        return None
    text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    links = parse_topo_matrix(text)
    if links is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:  # nvidia-smi lists every GPU; keep the visible ones, in CUDA's order
        indices = [int(v) for v in visible.split(",") if v.strip().isdigit()]
        if len(indices) != num_gpus or any(i >= len(links) for i in indices):
            return None
        links = tuple(tuple(links[i][j] for j in indices) for i in indices)
    return links if len(links) == num_gpus else None


def parse_topo_matrix(text: str) -> LinkMatrix | None:
    """The GPU-to-GPU part of ``nvidia-smi topo -m``: NV<n> -> n links, X -> None, anything else
    (SYS, NODE, PHB, PXB, PIX) -> 0.

    >>> parse_topo_matrix("\\tGPU0\\tGPU1\\tCPU Affinity\\nGPU0\\t X \\tNV18\\t0-15\\nGPU1\\tNV18\\t X \\t0-15\\n")
    ((None, 18), (18, None))
    """
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # nvidia-smi underlines the header with escape codes
    lines = [line for line in text.splitlines() if line.strip()]
    header = next((line for line in lines if re.match(r"^\s+GPU0\b", line)), None)
    if header is None:
        return None
    num_gpus = len(re.findall(r"\bGPU\d+\b", header))
    rows = []
    for index in range(num_gpus):
        row = next((line for line in lines if re.match(rf"^GPU{index}\s", line)), None)
        if row is None:
            return None
        cells = row.split()[1:1 + num_gpus]
        if len(cells) != num_gpus:
            return None
        rows.append(tuple(None if cell == "X" else int(cell[2:]) if re.fullmatch(r"NV\d+", cell) else 0
                          for cell in cells))
    return tuple(rows)
