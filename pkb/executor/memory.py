"""Evaluations side by side on GPUs, admitted by the memory they are measured to need.

Every evaluation's rank processes (its slot's reference, candidate and spare groups, and whatever a
candidate starts below them) are watched while it runs: the driver's count of their memory on each
device (pkb.runtime.gpu_memory), sampled a few times a second, gives its peak. The largest peak seen for
a problem at a (mode, world size) is what its next evaluation is taken to need; a problem not measured
yet is taken to need the largest of any problem at that mode and world size (finished or still running),
and while nothing at all has been measured the evaluations start one at a time. An evaluation starts
beside others only where every device keeps that much free, after the memory that the running ones may
still take on the way to their own need. What slips through (a candidate far hungrier than its problem's
earlier ones) fails for memory beside others and is judged again alone (pkb.executor.local).
"""

from __future__ import annotations

import threading
from typing import Callable

from pkb.executor.base import Evaluation
from pkb.runtime.gpu_memory import GIB, NvmlReader, Usage, usage_of
from pkb.runtime.proctree import children_by_parent, descendants

MARGIN = 1.25  # an estimate's room for a peak between two samples, and for one evaluation differing from another
SAMPLE_S = 0.25


def _problem_key(evaluation: Evaluation) -> tuple:
    return evaluation.problem.name, evaluation.config.mode, evaluation.config.world_size


def _config_key(evaluation: Evaluation) -> tuple:
    return evaluation.config.mode, evaluation.config.world_size


class GpuAdmission:
    """The measured peaks, and whether one more evaluation fits beside the running ones (``admits``)."""

    def __init__(self, reader: NvmlReader):
        self.reader = reader
        self._peaks: dict[tuple, Usage] = {}  # (problem, mode, W) -> the largest peak measured
        self._config_peaks: dict[tuple, Usage] = {}  # (mode, W) -> the largest peak of any problem
        # id -> the evaluation, its roots, its usage now, its peak
        self._watched: dict[int, tuple[Evaluation, Callable[[], list[int]], Usage, Usage]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._sample_forever, name="pkb-gpu-memory", daemon=True)
        self._thread.start()

    # -- what the executor calls -------------------------------------------------------------------------

    def watch(self, evaluation: Evaluation, roots: Callable[[], list[int]]) -> None:
        """Measure ``evaluation`` from now on: ``roots()`` gives the processes its rank groups descend from."""
        with self._lock:
            self._watched[id(evaluation)] = (evaluation, roots, Usage({}), Usage({}))
        self._wake.set()

    def finished(self, evaluation: Evaluation) -> Usage | None:
        """Stop measuring ``evaluation``; its peak (kept as its problem's need), or None if never measured."""
        self.sample()
        with self._lock:
            _, _, _, peak = self._watched.pop(id(evaluation), (None, None, None, Usage({})))
            if not peak.by_device:
                return None
            for table, key in ((self._peaks, _problem_key(evaluation)), (self._config_peaks, _config_key(evaluation))):
                table[key] = table[key].merged(peak) if key in table else peak
            return peak

    def need(self, evaluation: Evaluation) -> Usage | None:
        """What ``evaluation`` is taken to need (see the module docstring); None while nothing is measured."""
        with self._lock:
            if _problem_key(evaluation) in self._peaks:
                return self._peaks[_problem_key(evaluation)]
            config_key = _config_key(evaluation)
            known = [peak for (watched, _, _, peak) in self._watched.values() if _config_key(watched) == config_key
                     and peak.by_device]
            known += [self._config_peaks[config_key]] if config_key in self._config_peaks else []
        if not known:
            return None
        largest = known[0]
        for peak in known[1:]:
            largest = largest.merged(peak)
        return largest

    def admits(self, evaluation: Evaluation, held: list[int]) -> tuple[bool, str]:
        """Whether ``evaluation`` fits beside the running evaluations now, and why not; ``held``: the processes of
        the slot it would run in (their memory is in use already and counts towards its need)."""
        need = self.need(evaluation)
        if need is None:
            return False, "nothing measured yet at this mode and world size: one evaluation at a time until it is"
        per_process = self.reader.used_by_process()
        already = usage_of(descendants(held, children_by_parent()), per_process) if held else Usage({})
        free = self.reader.free_bytes()
        with self._lock:
            running = [(t, now) for (t, _, now, _) in self._watched.values()]
        for device, wanted in need.by_device.items():
            still_to_come = sum(max(0, (self.need(t) or now).by_device.get(device, 0) - now.by_device.get(device, 0))
                                for t, now in running)
            required = wanted * MARGIN - already.by_device.get(device, 0)
            if free.get(device, 0) - still_to_come < required:
                return False, (f"GPU {device}: {free.get(device, 0) / GIB:.1f} GiB free, {still_to_come / GIB:.1f} GiB of it "
                               f"still to come for the running evaluations, {required / GIB:.1f} GiB needed")
        return True, ""

    def sample(self) -> None:
        """Read every watched evaluation's memory now (one NVML read and one walk of /proc for all)."""
        with self._lock:
            watched = list(self._watched.items())
        if not watched:
            return
        per_process, tree = self.reader.used_by_process(), children_by_parent()
        for key, (evaluation, roots, _, _) in watched:
            now = usage_of(descendants(roots(), tree), per_process)
            with self._lock:
                if key in self._watched:
                    _, _, _, peak = self._watched[key]
                    self._watched[key] = (evaluation, roots, now, peak.merged(now))

    def close(self) -> None:
        self._stop = True
        self._wake.set()

    def _sample_forever(self) -> None:
        while not self._stop:
            if not self._watched:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                self.sample()
            except (RuntimeError, OSError):  # a driver hiccup: the next sample tries again
                pass
            self._wake.wait(SAMPLE_S)
