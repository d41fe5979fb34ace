"""Hardware profiles: what one GPU of a machine can do at most, as data with cited sources.

Per GPU: ``link_gbps`` is the interconnect bandwidth per direction (GB/s = 1e9 B/s; NVLink 4 on an
H100/H200 SXM: 18 links x 25 GB/s = 450 GB/s each way, "900 GB/s" bidirectional in the datasheet),
``hbm_gbps`` the device-memory bandwidth (reads plus writes), ``*_tflops`` dense tensor-core peaks
(no 2:4 sparsity; ``fp32_tflops`` is the non-tensor FP32 peak), ``latency_us`` the latency floor of
a small collective (see docs/roofline.md), ``network_gbps`` the GPU's share of the network between nodes
(its NIC, GB/s per direction: a run on several nodes, pkb.topology). Datasheet profiles have ``calibrated=False``;
``pkb calibrate`` writes a copy with the peaks measured on this machine (``calibrated=True``,
``based_on`` naming the datasheet profile it started from).

    >>> get_profile("h200_sxm_x8").link_gbps
    450.0
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

GB = 1e9
MiB = 1 << 20


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    gpu_model: str
    num_gpus: int  # GPUs in one NVLink (or PCIe) domain; 0 for the cpu profile (any number of processes)
    link_gbps: float  # per GPU, per direction
    hbm_gbps: float
    bf16_tflops: float  # dense
    fp8_tflops: float  # dense; 0 where the GPU has no fp8 tensor cores
    fp32_tflops: float  # non-tensor FP32
    l2_bytes: int
    hbm_bytes: int
    nvls: bool  # NVLink SHARP / multicast hardware exists (whether the environment allows it is separate)
    latency_us: float
    interconnect: str
    sources: tuple[str, ...]
    calibrated: bool = False
    based_on: str = ""  # for a calibrated profile: the datasheet profile it refines
    gpu_names: tuple[str, ...] = ()  # regexes matched against torch.cuda.get_device_name(), case-insensitive
    # per GPU, per direction, between nodes: one 400 Gb/s (NDR InfiniBand) ConnectX-7 port per GPU, the compute
    # fabric of NVIDIA's DGX H100, H200 and B200 reference architectures (8 x 400 Gb/s per node)
    network_gbps: float = 50.0

    def __post_init__(self):
        object.__setattr__(self, "sources", tuple(self.sources))
        object.__setattr__(self, "gpu_names", tuple(self.gpu_names))
        for name in ("link_gbps", "hbm_gbps", "bf16_tflops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"profile {self.name!r}: {name} must be > 0, got {getattr(self, name)!r}")
        if self.latency_us < 0 or self.num_gpus < 0:
            raise ValueError(f"profile {self.name!r}: latency_us and num_gpus must be >= 0")

    def matches(self, device_name: str) -> bool:
        return any(re.search(pattern, device_name, re.IGNORECASE) for pattern in self.gpu_names)

    def to_dict(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row["sources"], row["gpu_names"] = list(self.sources), list(self.gpu_names)
        return row

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> "HardwareProfile":
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in row.items() if k in known}
        values["sources"] = tuple(values.get("sources", ()))
        values["gpu_names"] = tuple(values.get("gpu_names", ()))
        return cls(**values)


_HOPPER_COMPUTE = dict(bf16_tflops=989.4, fp8_tflops=1978.9, fp32_tflops=66.9, l2_bytes=50 * MiB)
_NVLINK4 = dict(link_gbps=450.0, nvls=True, latency_us=5.0, interconnect="NVLink4 (18 links) + NVSwitch3")

_ALL = (
    HardwareProfile(
        name="h100_sxm_x8", description="8 x H100 SXM5 80GB (HGX/DGX H100), NVLink4 through NVSwitch",
        gpu_model="NVIDIA H100 80GB HBM3", num_gpus=8, hbm_gbps=3350.0, hbm_bytes=80 * 10**9,
        **_HOPPER_COMPUTE, **_NVLINK4,
        sources=("NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: 3.35 TB/s HBM3, 80 GB, BF16 1979 TFLOPS "
                 "with sparsity, FP8 3958 with sparsity, FP32 67 TFLOPS, NVLink 900 GB/s)",
                 "NVIDIA H100 Tensor Core GPU Architecture whitepaper (50 MB L2, 18 NVLink4 links, NVLink SHARP)",
                 "latency_us: pkb's floor estimate, docs/roofline.md"),
        gpu_names=(r"H100.*(SXM|HBM3)",),
    ),
    HardwareProfile(
        name="h200_sxm_x8", description="8 x H200 SXM 141GB (HGX H200), NVLink4 through NVSwitch",
        gpu_model="NVIDIA H200", num_gpus=8, hbm_gbps=4800.0, hbm_bytes=141 * 10**9,
        **_HOPPER_COMPUTE, **_NVLINK4,
        sources=("NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: 4.8 TB/s HBM3e, 141 GB, BF16 1979 TFLOPS "
                 "with sparsity, FP8 3958 with sparsity, FP32 67 TFLOPS, NVLink 900 GB/s)",
                 "NVIDIA H100 Tensor Core GPU Architecture whitepaper (same GH100 die: 50 MB L2, NVLink SHARP)",
                 "latency_us: pkb's floor estimate, docs/roofline.md"),
        gpu_names=(r"H200(?!.*NVL)",),
    ),
    HardwareProfile(
        name="b200_x8", description="8 x B200 (HGX/DGX B200), NVLink5 through NVSwitch",
        gpu_model="NVIDIA B200", num_gpus=8, link_gbps=900.0, hbm_gbps=8000.0, hbm_bytes=180 * 10**9,
        bf16_tflops=2250.0, fp8_tflops=4500.0, fp32_tflops=75.0, l2_bytes=126 * MiB, nvls=True, latency_us=5.0,
        interconnect="NVLink5 (18 links) + NVSwitch4",
        sources=("NVIDIA HGX B200 / DGX B200 datasheet (per 8 GPUs: FP8 72 PFLOPS and FP16/BF16 36 PFLOPS with "
                 "sparsity, FP32 600 TFLOPS, 1,440 GB HBM3e at 64 TB/s, NVLink 1.8 TB/s per GPU)",
                 "NVIDIA Blackwell Architecture Technical Brief (NVLink 5, NVLink SHARP)",
                 "l2_bytes: as the CUDA driver reports for B200 (not in the datasheet); latency_us: pkb's floor "
                 "estimate, docs/roofline.md"),
        gpu_names=(r"(?<!G)B200",),
    ),
    HardwareProfile(
        name="gb200_nvl72", description="GB200 NVL72: 72 Blackwell GPUs in one NVLink5 domain",
        gpu_model="NVIDIA GB200", num_gpus=72, link_gbps=900.0, hbm_gbps=8000.0, hbm_bytes=186 * 10**9,
        bf16_tflops=2500.0, fp8_tflops=5000.0, fp32_tflops=80.0, l2_bytes=126 * MiB, nvls=True, latency_us=5.0,
        interconnect="NVLink5 + NVLink Switch trays (72-GPU domain)",
        sources=("NVIDIA GB200 NVL72 datasheet (per 72 GPUs: FP8 720 PFLOPS and FP16/BF16 360 PFLOPS with "
                 "sparsity, FP32 5,760 TFLOPS, 13.4 TB HBM3e at 576 TB/s, NVLink 130 TB/s)",
                 "l2_bytes: as for B200; latency_us: pkb's floor estimate, docs/roofline.md"),
        gpu_names=(r"GB200",),
    ),
    HardwareProfile(
        name="pcie_gen4_x8", description="8 x A100 80GB PCIe on PCIe Gen4 x16, no NVLink bridges",
        gpu_model="NVIDIA A100 80GB PCIe", num_gpus=8, link_gbps=32.0, hbm_gbps=1935.0, hbm_bytes=80 * 10**9,
        bf16_tflops=312.0, fp8_tflops=0.0, fp32_tflops=19.5, l2_bytes=40 * MiB, nvls=False, latency_us=10.0,
        network_gbps=25.0,  # one 200 Gb/s (HDR) port per GPU, as such PCIe servers are built
        interconnect="PCIe Gen4 x16, no NVLink",
        sources=("NVIDIA A100 Tensor Core GPU datasheet (A100 80GB PCIe: 1,935 GB/s HBM2e, BF16 312 TFLOPS, "
                 "FP32 19.5 TFLOPS, PCIe Gen4 64 GB/s bidirectional)",
                 "PCI Express Base Specification 4.0 (16 GT/s x16: about 32 GB/s per direction; about 25 "
                 "achievable)", "latency_us: pkb's floor estimate, docs/roofline.md"),
        gpu_names=(r"A100.*PCIe",),
    ),
    HardwareProfile(
        name="pcie_gen5_x8", description="8 x H100 PCIe 80GB on PCIe Gen5 x16, no NVLink bridges",
        gpu_model="NVIDIA H100 PCIe", num_gpus=8, link_gbps=64.0, hbm_gbps=2000.0, hbm_bytes=80 * 10**9,
        bf16_tflops=756.0, fp8_tflops=1513.0, fp32_tflops=51.0, l2_bytes=50 * MiB, nvls=False, latency_us=10.0,
        interconnect="PCIe Gen5 x16, no NVLink",
        sources=("NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe: 2 TB/s HBM2e, BF16 1,513 TFLOPS and FP8 "
                 "3,026 with sparsity, FP32 51 TFLOPS, PCIe Gen5 128 GB/s bidirectional)",
                 "PCI Express Base Specification 5.0 (32 GT/s x16: about 64 GB/s per direction)",
                 "latency_us: pkb's floor estimate, docs/roofline.md"),
        gpu_names=(r"H100.*PCIe",),
    ),
    HardwareProfile(
        name="cpu", description="plumbing only: ranks are CPU processes over gloo; numbers are one laptop "
                                "core's order of magnitude, so cpu-mode rows have a roofline at all",
        gpu_model="cpu", num_gpus=0, link_gbps=2.0, hbm_gbps=10.0, bf16_tflops=0.05, fp8_tflops=0.0,
        fp32_tflops=0.1, l2_bytes=32 * MiB, hbm_bytes=16 * 10**9, nvls=False, latency_us=50.0, network_gbps=1.0,
        interconnect="gloo over loopback TCP",
        sources=("pkb's own round numbers for one CPU core and loopback TCP; not a datasheet, not GPU performance",),
    ),
)

PROFILES: dict[str, HardwareProfile] = {profile.name: profile for profile in _ALL}


def get_profile(name: str) -> HardwareProfile:
    """A datasheet profile by name; the error lists the valid names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown hardware profile {name!r}; profiles: {', '.join(PROFILES)}") from None


def profile_for_gpu(device_name: str) -> HardwareProfile | None:
    """The datasheet profile whose GPU matches ``device_name`` (e.g. 'NVIDIA H200'), or None."""
    for profile in PROFILES.values():
        if profile.matches(device_name):
            return profile
    return None
