"""``pkb calibrate``: measure this machine's peaks and store them as a calibrated HardwareProfile.

What is measured, and how (docs/roofline.md has the reasoning):

- HBM copy bandwidth and bf16 GEMM throughput: the probes of ``pkb.measure.probes`` (a 1 GiB
  device copy, an 8192^3 bf16 GEMM) timed through the harness itself (``time_reference`` in cuda
  mode, W=1), so calibration and real results are timed the same way.
- With two or more GPUs, in a group of one spawned process per GPU (``_sweep_worker``):
  copy-engine peer bandwidth (``dst.copy_(src)`` across devices in one process) for every ordered
  pair, SM-driven peer bandwidth (an elementwise kernel reading a peer's symmetric-memory buffer)
  for every ordered pair, NCCL all-reduce and all-gather (the calls of the NCCL probes of
  ``pkb.measure.probes``) over the size sweep of the allreduce and allgather problems in a plain
  CUDA-event loop (busbw from those problems' own ``cost()``), and the latency of a small
  collective (a device-side symmetric-memory barrier and the smallest NCCL all-reduce).

NVLink multicast stays off: the workers inherit the environment and default NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 where they are unset.

The profile is stored as JSON under the cache directory (``$PKB_CACHE_DIR``, else
``$XDG_CACHE_HOME/pkb``, else ``~/.cache/pkb``) in ``hardware/<gpu model>_x<count>.json``, where
``pkb.hardware.detect.choose_profile`` finds it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from pkb.hardware.profiles import HardwareProfile
from pkb.hardware.stored import FORMAT_VERSION, cache_dir, calibrated_path, load_calibrated  # noqa: F401

SWEEP_TIMEOUT_S = 600.0
PAIR_BYTES = 256 << 20  # per-pair copy size for every ordered pair
SWEEP_BYTES = (4 << 10, 1 << 20, 64 << 20, 1 << 30)  # copy-engine size sweep on the pair 0 -> 1
NUM_REPEATS = 3


class CalibrationError(RuntimeError):
    """Calibration cannot run here; the message says why and what to do."""


@dataclass(frozen=True)
class Calibration:
    """What ``pkb calibrate`` measured, the profile built from it, and the datasheet it started from."""

    profile: HardwareProfile
    datasheet: HardwareProfile
    machine: dict[str, Any]
    measurements: dict[str, Any]
    errors: tuple[str, ...] = ()
    versions: dict[str, str] = field(default_factory=dict)
    created_at: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "created_at": self.created_at, "profile": self.profile.to_dict(),
                "datasheet": self.datasheet.name, "machine": self.machine, "versions": self.versions,
                "measurements": self.measurements, "errors": list(self.errors)}


# -- storage ----------------------------------------------------------------------------------------


def save_calibration(calibration: Calibration, extra_path: Path | None = None) -> Path:
    """Write the calibration where ``choose_profile`` finds it (and a copy to ``extra_path``); returns the first."""
    path = calibrated_path(calibration.profile.gpu_model, calibration.profile.num_gpus)
    text = json.dumps(calibration.to_dict(), indent=1)
    for target in (path, extra_path):
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text + "\n")
    return path


# -- the whole calibration -------------------------------------------------------------------------


def calibrate(log: Callable[[str], None] = lambda line: None) -> Calibration:
    """Measure this machine and build its calibrated profile (not stored: see ``save_calibration``)."""
    from pkb.hardware.detect import choose_profile, detect

    machine = detect()
    if machine.num_gpus == 0:
        raise CalibrationError("pkb calibrate measures GPUs and this machine has none visible (torch.cuda."
                               "is_available() is False); cpu mode uses the `cpu` plumbing profile (`pkb hardware` "
                               "lists the profiles)")
    datasheet = choose_profile(machine, calibrated=False)
    measurements: dict[str, Any] = {}
    errors: list[str] = []
    log(f"calibrating {machine.num_gpus} x {machine.gpu_model} (datasheet profile: {datasheet.name})")
    measurements.update(measure_single_gpu(log))
    if machine.num_gpus >= 2:
        try:
            measurements.update(measure_multi_gpu(machine.num_gpus, log))
        except CalibrationError as exc:
            errors.append(str(exc))
            log(f"multi-GPU sweeps failed: {exc}")
    else:
        log("one GPU: peer and NCCL sweeps need two or more; link numbers stay the datasheet's")
    errors.extend(f"{part}: {message}" for part, message in measurements.pop("errors", {}).items())
    return Calibration(profile=build_profile(datasheet, machine.gpu_model, machine.num_gpus, measurements),
                       datasheet=datasheet, machine=machine.to_dict(), measurements=measurements,
                       errors=tuple(errors), versions=_versions(), created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                           time.gmtime()))


def build_profile(datasheet: HardwareProfile, gpu_model: str, num_gpus: int,
                  measurements: dict[str, Any]) -> HardwareProfile:
    """The datasheet profile with every measured peak replaced by its measurement."""
    measured: dict[str, Any] = {}
    notes = []
    if measurements.get("hbm"):
        measured["hbm_gbps"] = measurements["hbm"]["gbps"]
        notes.append("hbm_gbps: probe_copy copy_1GiB through the harness (read + write counted)")
    if measurements.get("gemm"):
        measured["bf16_tflops"] = measurements["gemm"]["tflops"]
        notes.append("bf16_tflops: probe_gemm gemm_8192 through the harness")
    link = best_link_gbps(measurements)
    if link:
        measured["link_gbps"] = link
        notes.append("link_gbps: the larger of the median over GPU pairs of the best peer copy (copy engine or "
                     "SM) and the best NCCL all-reduce / all-gather busbw")
    latencies = [v for v in (measurements.get("barrier_us"), _smallest_all_reduce_us(measurements)) if v]
    if latencies:
        measured["latency_us"] = min(latencies)
        notes.append("latency_us: the faster of a symmetric-memory device barrier and the smallest NCCL all-reduce")
    for name in ("l2_bytes", "hbm_bytes"):
        if measurements.get(name):
            measured[name] = int(measurements[name])
    kept = [name for name in ("link_gbps", "hbm_gbps", "bf16_tflops", "latency_us") if name not in measured]
    kept += ["fp8_tflops", "fp32_tflops", "nvls"]
    return replace(
        datasheet, **measured, name=f"calibrated_{calibrated_path(gpu_model, num_gpus).stem}",
        description=f"{num_gpus} x {gpu_model} as measured by pkb calibrate", gpu_model=gpu_model,
        num_gpus=num_gpus, calibrated=True, based_on=datasheet.name,
        sources=(f"pkb calibrate on this machine: {'; '.join(notes) or 'nothing measured'}",
                 f"not measured, from the datasheet profile {datasheet.name}: {', '.join(kept)}", *datasheet.sources))


def best_link_gbps(measurements: dict[str, Any]) -> float | None:
    per_pair: dict[tuple[int, int], float] = {}
    for row in measurements.get("copy_engine", []) + measurements.get("sm_peer", []):
        if row["bytes"] >= PAIR_BYTES:
            key = (row["src"], row["dst"])
            per_pair[key] = max(per_pair.get(key, 0.0), row["gbps"])
    candidates = [statistics.median(per_pair.values())] if per_pair else []
    candidates += [row["busbw_gbps"] for kind in ("all_reduce", "all_gather") for row in measurements.get(kind, [])]
    return max(candidates) if candidates else None


def _smallest_all_reduce_us(measurements: dict[str, Any]) -> float | None:
    rows = measurements.get("all_reduce") or []
    return min(rows, key=lambda row: row["bytes"])["seconds"] * 1e6 if rows else None


def _versions() -> dict[str, str]:
    import torch

    from pkb import __version__

    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else ""
    return {"pkb": __version__, "torch": torch.__version__, "cuda": str(torch.version.cuda), "nccl": nccl}


# -- single GPU: the probes through the harness ----------------------------------------------------


PROBE_TIMEOUT_S = 300.0  # one single-GPU probe's timing (a GEMM, a device copy)


def measure_single_gpu(log: Callable[[str], None]) -> dict[str, Any]:
    import torch

    from pkb.evaluate.config import resolve
    from pkb.evaluate.session import Session
    from pkb.evaluate.timing import time_reference
    from pkb.measure.probes import COPY, GEMM
    from pkb.runtime.modes import Mode

    config = resolve({"perf": True, "timeout": PROBE_TIMEOUT_S, "world_size": 1, "mode": "cuda"}).config
    props = torch.cuda.get_device_properties(0)
    result: dict[str, Any] = {"l2_bytes": int(props.L2_cache_size), "hbm_bytes": int(props.total_memory)}
    with Session(Mode.CUDA, 1) as session:
        for problem, key in ((COPY, "hbm"), (GEMM, "gemm")):
            case = problem.benchmarks[0]
            timing = time_reference(session, problem, case, config)
            seconds, spread, disagreement = timing.per_call_s(), timing.spread, timing.timer_disagreement
            cost = problem.cost(case, 1)
            row = {"probe": problem.name, "case": case.name, "seconds": seconds, "spread": spread,
                   "timer_disagreement": disagreement}
            if cost.flops:
                row["tflops"] = cost.flops / seconds / 1e12
                log(f"bf16 GEMM {case.name}: {seconds * 1e6:.1f} us, {row['tflops']:.0f} TFLOP/s")
            else:
                row["gbps"] = cost.hbm_bytes / seconds / 1e9
                log(f"HBM copy {case.name}: {seconds * 1e6:.1f} us, {row['gbps']:.0f} GB/s (read + write)")
            result[key] = row
    return result


# -- several GPUs: a spawned group, one process per GPU --------------------------------------------


def measure_multi_gpu(num_gpus: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Peer copies, NCCL sweeps and latency over ``num_gpus`` GPUs; busbw from the problems' costs."""
    from pkb.registry import get_problem

    collectives = {kind: get_problem(slug) for kind, slug in (("all_reduce", "allreduce"), ("all_gather", "allgather"))}
    plan = {"pair_bytes": PAIR_BYTES, "sweep_bytes": list(SWEEP_BYTES), "num_repeats": NUM_REPEATS,
            "collectives": [(kind, case.name, _numel(case)) for kind, problem in collectives.items()
                            for case in problem.cases("benchmarks", num_gpus)]}
    log(f"peer copies and NCCL sweeps on {num_gpus} GPUs (one process per GPU)...")
    per_rank = _run_group(num_gpus, plan)
    result: dict[str, Any] = {"copy_engine": per_rank[0].get("copy_engine", []),
                              "sm_peer": [row for reply in per_rank for row in reply.get("sm_peer", [])]}
    errors = {part: message for reply in per_rank for part, message in reply.get("errors", {}).items()}
    for kind, problem in collectives.items():
        rows = []
        for case in problem.cases("benchmarks", num_gpus):
            seconds = _slowest_rank_median([reply["collectives"][f"{kind}/{case.name}"] for reply in per_rank])
            link_bytes = problem.cost(case, num_gpus).link_bytes
            rows.append({"case": case.name, "bytes": _numel(case) * 2, "seconds": seconds,
                         "busbw_gbps": link_bytes / seconds / 1e9})
            log(f"NCCL {kind} {case.name}: {seconds * 1e6:.1f} us, busbw {rows[-1]['busbw_gbps']:.1f} GB/s")
        result[kind] = rows
    if all(reply.get("barrier_s") for reply in per_rank):
        result["barrier_us"] = _slowest_rank_median([reply["barrier_s"] for reply in per_rank]) * 1e6
        log(f"symmetric-memory barrier: {result['barrier_us']:.1f} us")
    for name in ("copy_engine", "sm_peer"):
        best = max((row["gbps"] for row in result[name] if row["bytes"] >= PAIR_BYTES), default=0.0)
        log(f"{name.replace('_', ' ').replace('sm', 'SM-driven')} peer bandwidth: best pair {best:.0f} GB/s over {len(result[name])} measurements")
    if errors:
        result["errors"] = errors
    return result


def _numel(case) -> int:
    import math

    return math.prod(case["shape"])


def _slowest_per_repeat(per_rank_repeats: list[list[float]]) -> list[float]:
    """Per repeat, the slowest rank's time (the harness counts a collective call that way)."""
    return [max(repeats[i] for repeats in per_rank_repeats) for i in range(len(per_rank_repeats[0]))]


def _slowest_rank_median(per_rank_repeats: list[list[float]]) -> float:
    """The harness's statistic: per repeat the slowest rank, then the median over repeats."""
    return statistics.median(_slowest_per_repeat(per_rank_repeats))


def _run_group(num_gpus: int, plan: dict) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="pkb-calibrate-") as folder:
        context = mp.start_processes(_sweep_worker, args=(num_gpus, folder, plan), nprocs=num_gpus, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + SWEEP_TIMEOUT_S
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    raise CalibrationError(f"the peer and NCCL sweeps did not finish within {SWEEP_TIMEOUT_S:.0f} s")
        except mp.ProcessRaisedException as exc:
            raise CalibrationError(f"a sweep process failed: {str(exc).strip().splitlines()[-1]}") from None
        except mp.ProcessExitedException as exc:
            raise CalibrationError(f"a sweep process died: {exc}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [json.loads(Path(folder, f"rank{rank}.json").read_text()) for rank in range(num_gpus)]


def _sweep_worker(rank: int, world_size: int, folder: str, plan: dict) -> None:
    """One rank of the sweep group (spawned; not for use by hand). Writes ``rank<r>.json`` to ``folder``."""
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(name, value)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's notes on deprecated symm-mem calls
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    store = dist.FileStore(os.path.join(folder, "store"), world_size)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=SWEEP_TIMEOUT_S), device_id=torch.device("cuda", rank))
    host_group = dist.new_group(backend="gloo")  # waits that keep no GPU busy while one rank measures
    reply: dict[str, Any] = {"errors": {}}
    if plan.get("peer", True):
        if rank == 0:
            reply["copy_engine"] = _copy_engine_pairs(world_size, plan)
        dist.barrier(group=host_group)
        try:
            reply["sm_peer"], reply["barrier_s"] = _symmetric_memory_sweeps(rank, world_size, plan, host_group)
        except Exception as exc:  # symmetric memory unavailable: the NCCL sweeps still run
            reply["errors"]["sm_peer"] = f"{type(exc).__name__}: {exc}"
            dist.barrier(group=host_group)
    reply["collectives"] = {f"{kind}/{case}": _time_collective(kind, numel, plan["num_repeats"])
                            for kind, case, numel in plan["collectives"]}
    Path(folder, f"rank{rank}.json").write_text(json.dumps(reply))
    dist.barrier(group=host_group)
    dist.destroy_process_group()


def _iterations(num_bytes: int, low: int = 10, high: int = 500) -> int:
    """Calls per repeat: many for small messages, a few for GiB ones (the same on every rank)."""
    return max(low, min(high, (4 << 30) // max(num_bytes, 1)))


def _copy_engine_pairs(world_size: int, plan: dict) -> list[dict]:
    """Cross-device ``dst.copy_(src)`` in this one process: a peer copy by the copy engine."""
    import torch

    rows = []
    for src in range(world_size):
        for dst in range(world_size):
            if src == dst:
                continue
            sizes = plan["sweep_bytes"] if (src, dst) == (0, 1) else [plan["pair_bytes"]]
            for num_bytes in sizes:
                a = torch.zeros(num_bytes // 2, dtype=torch.bfloat16, device=f"cuda:{src}")
                b = torch.empty_like(a, device=f"cuda:{dst}")

                def sync():
                    torch.cuda.synchronize(src)
                    torch.cuda.synchronize(dst)

                seconds = _wall_per_call(lambda: b.copy_(a), _iterations(num_bytes), plan["num_repeats"], sync)
                rows.append({"src": src, "dst": dst, "bytes": num_bytes, "seconds": seconds,
                             "gbps": num_bytes / seconds / 1e9})
                del a, b
        torch.cuda.empty_cache()
    return rows


def _wall_per_call(fn, iterations: int, num_repeats: int, sync) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(num_repeats):
        began = time.perf_counter()
        for _ in range(iterations):
            fn()
        sync()
        times.append((time.perf_counter() - began) / iterations)
    return statistics.median(times)


def _event_per_call(fn, iterations: int, num_repeats: int) -> list[float]:
    """Seconds per call for each repeat, by CUDA events on the current stream around the loop."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(num_repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iterations)
    return times


def _symmetric_memory_sweeps(rank: int, world_size: int, plan: dict, host_group) -> tuple[list[dict], list[float]]:
    """SM-driven peer reads (one reader at a time, every ordered pair) and a device-side barrier's latency."""
    import torch
    import torch.distributed as dist

    from pkb.kernels.symm import symmetric_buffer

    buffer = symmetric_buffer((plan["pair_bytes"] // 2,), torch.bfloat16)
    buffer.local.zero_()
    out = torch.empty_like(buffer.local)
    torch.cuda.synchronize()
    dist.barrier(group=host_group)
    rows = []
    for reader in range(world_size):
        for source in range(world_size):
            if reader == rank and source != rank:
                sizes = [b for b in plan["sweep_bytes"] if b < plan["pair_bytes"]] if (reader, source) == (0, 1) else []
                for num_bytes in sizes + [plan["pair_bytes"]]:
                    numel = num_bytes // 2
                    peer = buffer.peer(source)[:numel]
                    seconds = statistics.median(_event_per_call(lambda: torch.neg(peer, out=out[:numel]),
                                                                _iterations(num_bytes), plan["num_repeats"]))
                    rows.append({"src": source, "dst": reader, "bytes": num_bytes, "seconds": seconds,
                                 "gbps": num_bytes / seconds / 1e9})
            if source != reader:
                dist.barrier(group=host_group)
    barrier_s = _event_per_call(lambda: buffer.barrier(), 200, plan["num_repeats"])
    torch.cuda.synchronize()
    dist.barrier(group=host_group)
    return rows, barrier_s


def _time_collective(kind: str, numel: int, num_repeats: int) -> list[float]:
    """A plain CUDA-event loop over the NCCL probe's call (``pkb.measure.probes``) on one bf16 buffer."""
    import torch

    from pkb.measure.probes import NCCL_PROBES

    call = NCCL_PROBES[kind].reference
    tensor = torch.randn(numel, device="cuda").to(torch.bfloat16)
    times = _event_per_call(lambda: call(tensor), _iterations(numel * 2), num_repeats)
    del tensor
    torch.cuda.empty_cache()
    return times


def time_collectives_plainly(num_gpus: int, sizes: list[tuple[str, str, int]], num_repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each ``(kind, label, numel)`` by the plain loop of ``_time_collective`` in a
    spawned group of ``num_gpus`` processes: per repeat the slowest rank, as the harness counts."""
    per_rank = _run_group(num_gpus, {"peer": False, "num_repeats": num_repeats, "collectives": sizes})
    return {key: _slowest_per_repeat([reply["collectives"][key] for reply in per_rank]) for key in per_rank[0]["collectives"]}


def print_summary(calibration: Calibration, file=sys.stdout) -> None:
    """Measured peaks next to the datasheet's, one line each."""
    measured, datasheet = calibration.profile, calibration.datasheet
    print(f"calibrated profile {measured.name} (datasheet: {datasheet.name})", file=file)
    for name, unit in (("hbm_gbps", "GB/s"), ("bf16_tflops", "TFLOP/s"), ("link_gbps", "GB/s"), ("latency_us", "us")):
        mine, theirs = getattr(measured, name), getattr(datasheet, name)
        same = " (not measured)" if mine == theirs else f"  ({mine / theirs * 100:.0f}% of datasheet)"
        print(f"  {name:<12} {mine:10.1f} {unit:<8} datasheet {theirs:10.1f}{same}", file=file)
    for error in calibration.errors:
        print(f"  error: {error}", file=file)
