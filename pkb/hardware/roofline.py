"""The roofline: the least time one call can take on a hardware profile, from the problem's Cost.

Per rank (docs/roofline.md derives it):

    link_s    = link_bytes / link bandwidth (NVLink, per direction)
    network_s = network_bytes / the GPU's network bandwidth (its NIC, per direction; runs on several nodes)
    latency_s = the profile's small-collective latency floor, when anything crosses the link (else 0)
    compute_s = flops / dense bf16 tensor-core peak
    memory_s  = hbm_bytes / HBM bandwidth
    bound_s   = max(link_s + latency_s, network_s + latency_s, compute_s, memory_s)

NVLink and the network carry data at once, so their terms are apart (a transfer over each takes at least
its own bytes over its own bandwidth). The latency floor adds to the link and network terms (a message's first byte arrives only after it: the alpha in
alpha + n/beta) but not to the others, which a kernel may overlap with communication; so the bound
never claims more than the alpha-beta model allows. ``bound_by`` names the largest term ("latency"
when the latency floor outweighs the link bytes' own time).

    >>> from pkb.problem import Cost
    >>> from pkb.hardware.profiles import get_profile
    >>> r = roofline(Cost(link_bytes=450e9 * 1e-3), get_profile("h200_sxm_x8"), world_size=8)
    >>> round(r.link_s * 1e3, 6), r.bound_by
    (1.0, 'link')
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pkb.hardware.profiles import HardwareProfile
from pkb.problem import Cost

BOUND_KINDS = ("link", "network", "compute", "memory", "latency")


@dataclass(frozen=True)
class Roofline:
    bound_s: float
    bound_by: str  # one of BOUND_KINDS
    link_s: float
    compute_s: float
    memory_s: float
    latency_s: float
    network_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def roofline(cost: Cost, profile: HardwareProfile, world_size: int) -> Roofline:
    """The lower bound on one call's time for ``cost`` (per rank) on ``profile`` at ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # Beyond the profile's NVLink domain (world_size > profile.num_gpus, e.g. shared-gpu mode) the bound
    # stays a valid, optimistic lower bound: the per-GPU link is the fastest path any byte can take.
    moves_data = world_size > 1 and (cost.link_bytes > 0 or cost.network_bytes > 0)
    link_s = cost.link_bytes / (profile.link_gbps * 1e9) if moves_data else 0.0
    network_s = cost.network_bytes / (profile.network_gbps * 1e9) if moves_data else 0.0
    latency_s = profile.latency_us * 1e-6 if moves_data else 0.0
    compute_s = cost.flops / (profile.bf16_tflops * 1e12)
    memory_s = cost.hbm_bytes / (profile.hbm_gbps * 1e9)
    terms = {"link": link_s + latency_s, "network": network_s + latency_s if network_s else 0.0,
             "compute": compute_s, "memory": memory_s}
    bound_by = max(terms, key=terms.get)
    if bound_by in ("link", "network") and latency_s > (link_s if bound_by == "link" else network_s):
        bound_by = "latency"
    return Roofline(bound_s=max(terms.values()), bound_by=bound_by, link_s=link_s, compute_s=compute_s,
                    memory_s=memory_s, latency_s=latency_s, network_s=network_s)


def roofline_fraction(bound_s: float, measured_s: float) -> float:
    """bound / measured: 1.0 is at the roofline, 0.25 is four times slower than it allows."""
    if measured_s <= 0:
        raise ValueError(f"measured time must be > 0, got {measured_s}")
    return bound_s / measured_s


def busbw_gbps(cost: Cost, measured_s: float) -> float | None:
    """Bus bandwidth in GB/s (link bytes per rank / time, as nccl-tests counts it); None without link bytes."""
    if not cost.link_bytes or measured_s <= 0:
        return None
    return cost.link_bytes / measured_s / 1e9
