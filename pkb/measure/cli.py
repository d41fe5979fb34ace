"""``pkb hardware``, ``pkb calibrate`` and ``pkb baseline`` (added to the ``pkb`` parser by pkb.cli).

Nothing heavy is imported at module level: ``pkb --help`` must stay fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pkb.console import shorten


BASELINE_TIMEOUT_S = 300.0  # `pkb baseline --timeout`'s default: one case's timing


def add_commands(subparsers) -> None:
    from pkb.commands import add_option
    from pkb.options import OPTIONS

    p = subparsers.add_parser("hardware", help="this machine as detected, the profile the roofline uses, all profiles")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_hardware)

    p = subparsers.add_parser("calibrate", help="measure this machine's peaks and store a calibrated profile")
    p.add_argument("--out", help="also write the calibration JSON here (it is always stored where pkb finds it)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_calibrate)

    p = subparsers.add_parser("baseline", help="time every selected reference: busbw, %% of roofline, bound")
    p.add_argument("--problems", help="e.g. 1-8,12,allgather_gemm or a category; default: all")
    add_option(p, OPTIONS["world_size"], default=2, help="ranks (default 2; 1 times the single-device probes)")
    add_option(p, OPTIONS["mode"])
    p.add_argument("--profile", help="judge against this datasheet profile (default: calibrated for this machine if stored, "
                                     "else its datasheet profile; `cpu` in cpu mode)")
    add_option(p, OPTIONS["timeout"], default=BASELINE_TIMEOUT_S,
               help=f"seconds one case's timing may take (default {BASELINE_TIMEOUT_S:g})")
    p.add_argument("--cuda-graph", action="store_true", help="in cuda mode: time CUDA-graph replays")
    p.add_argument("--out", help="also write the rows as JSON here, rewritten after every row (a cut run keeps its rows)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_baseline)


# -- hardware ---------------------------------------------------------------------------------------


def cmd_hardware(args) -> int:
    from pkb.hardware.detect import choose_profile, detect
    from pkb.hardware.profiles import PROFILES

    machine = detect()
    chosen = choose_profile(machine)
    if args.json:
        print(json.dumps({"machine": machine.to_dict(), "profile": chosen.to_dict(),
                          "profiles": [p.to_dict() for p in PROFILES.values()]}, indent=1))
        return 0
    print_machine(machine)
    print(f"\nprofile: {chosen.name} ({'calibrated on this machine' if chosen.calibrated else 'datasheet'}): "
          f"{chosen.description}")
    if machine.num_gpus == 0:
        print("  (no GPU: cpu mode times are not GPU performance; their roofline uses the cpu plumbing profile)")
    print()
    print_profiles(list(PROFILES.values()) + ([chosen] if chosen.calibrated else []))
    return 0


def print_machine(machine) -> None:
    if machine.num_gpus == 0:
        print("machine: no GPU visible (torch.cuda.is_available() is False); pkb runs in cpu mode")
    else:
        print(f"machine: {machine.num_gpus} x {machine.gpu_model}")
        if len(set(machine.gpu_names)) > 1:
            print(f"  GPUs: {', '.join(machine.gpu_names)}")
        if machine.nvlink_links is None:
            print("  NVLink links per peer: unknown (install nvidia-ml-py, or put nvidia-smi on PATH)")
        else:
            print(f"  NVLink links per peer (from {machine.nvlink_source}):")
            _print_matrix(machine.nvlink_links, lambda v: "X" if v is None else f"NV{v}" if v else "-")
        print("  P2P access (row reads column):")
        _print_matrix(machine.p2p_access, lambda v: "yes" if v else "no")
    switches = ", ".join(f"{name}={value}" for name, value in machine.nvls_env.items() if value is not None)
    state = "disabled by the environment" if machine.nvls_disabled_by_env else "not disabled by the environment"
    print(f"  NVLS/multicast: {state}" + (f" ({switches})" if switches else ""))


def _print_matrix(matrix, cell) -> None:
    size = len(matrix)
    print("        " + "".join(f"GPU{j:<5}" for j in range(size)))
    for i, row in enumerate(matrix):
        print(f"    GPU{i:<4}" + "".join(f"{cell(v):<8}" for v in row))


def print_profiles(profiles) -> None:
    from pkb.console import print_table

    rows = [{"name": p.name, "gpus": p.num_gpus or "-", "link": f"{p.link_gbps:g}", "hbm": f"{p.hbm_gbps:g}",
             "bf16": f"{p.bf16_tflops:g}", "latency": f"{p.latency_us:g}", "nvls": "yes" if p.nvls else "no",
             "interconnect": p.interconnect} for p in profiles]
    print_table(rows, ["name", "gpus", "link", "hbm", "bf16", "latency", "nvls", "interconnect"],
                headers=["profile", "GPUs", "link GB/s", "HBM GB/s", "bf16 TFLOP/s", "latency us", "NVLS",
                         "interconnect"])
    print("\n(link: per GPU per direction; bf16: dense tensor-core peak; sources: `pkb hardware --json`)")


# -- calibrate --------------------------------------------------------------------------------------


def cmd_calibrate(args) -> int:
    from pkb.console import UsageError
    from pkb.measure.calibrate import CalibrationError, calibrate, print_summary, save_calibration

    if args.out and Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a directory: give the JSON file's name")
    log = (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        calibration = calibrate(log)
    except CalibrationError as exc:
        raise UsageError(str(exc)) from None
    path = save_calibration(calibration, Path(args.out) if args.out else None)
    if args.json:
        print(json.dumps({**calibration.to_dict(), "stored_at": str(path)}, indent=1))
    else:
        print_summary(calibration)
        print(f"stored at {path}" + (f" and {args.out}" if args.out else "")
              + "; `pkb hardware` and `pkb baseline` now use it")
    return 1 if calibration.errors else 0


# -- baseline ---------------------------------------------------------------------------------------


def cmd_baseline(args) -> int:
    from pkb.console import UsageError
    from pkb.measure.baseline import run_baseline
    from pkb.registry import select
    from pkb.evaluate.config import OptionError, resolve

    if args.out and Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a directory: give the JSON file's name")
    problems = select(args.problems)
    if args.world_size == 1:  # no suite problem runs on one device; the machine probes do
        from pkb.measure.probes import COPY, GEMM

        problems = [*problems, GEMM, COPY]
    try:
        resolved = resolve({"mode": args.mode, "world_size": args.world_size, "perf": True, "timeout": args.timeout,
                            "cuda_graph": args.cuda_graph})
    except OptionError as exc:
        raise UsageError(str(exc)) from None
    config = resolved.config
    profile = _baseline_profile(args.profile, config.mode)
    if not args.json:
        print(f"mode: {config.mode} ({resolved.mode_reason}); profile: {profile.name}"
              + (" (calibrated)" if profile.calibrated else ""), file=sys.stderr)
    printer = _RowPrinter(sys.stderr if args.json else sys.stdout, problems, args.world_size,
                          datasheet_column=profile.calibrated)  # with --json: progress on stderr
    measured = []

    def on_row(row) -> None:
        printer.row(row)
        measured.append(row)
        if args.out:
            _write_json(args.out, _baseline_report(measured, [], profile))

    rows, skipped = run_baseline(problems, config, profile, on_row=on_row)
    report = _baseline_report(rows, skipped, profile)
    if args.out:
        _write_json(args.out, report)
    if args.json:
        print(json.dumps(report, default=str))
    else:
        by_reason: dict[str, list[str]] = {}
        for item in skipped:
            by_reason.setdefault(item.reason, []).append(item.problem)
        for reason, names in by_reason.items():
            shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            print(f"skipped {shown}: {reason}")
        if rows and not rows[0].times_are_gpu_performance:
            print(f"(CPU times: measured in {config.mode} mode, not GPU performance; the roofline uses the "
                  f"{profile.name} profile)")
    if not rows and skipped:
        raise UsageError(f"no selected problem runs at world size {args.world_size}; pick one with --world-size")
    return 1 if any(row.error for row in rows) else 0


def _baseline_report(rows, skipped, profile) -> dict:
    return {"rows": [row.to_dict() for row in rows],
            "skipped": [{"problem": s.problem, "reason": s.reason} for s in skipped],
            "profile": profile.to_dict()}


def _write_json(path: str, data: dict) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(data, indent=1, default=str))
    partial.replace(target)  # a reader never sees half a file


def _baseline_profile(name: str | None, mode):
    from pkb.console import UsageError
    from pkb.hardware.detect import choose_profile, detect
    from pkb.hardware.profiles import get_profile
    from pkb.runtime.modes import Mode

    if name:
        try:
            return get_profile(name)
        except KeyError as exc:
            raise UsageError(exc.args[0]) from None
    return get_profile("cpu") if mode is Mode.CPU else choose_profile(detect())


class _RowPrinter:
    """Prints each row as it is measured, under one header; columns as wide as the selected names."""

    def __init__(self, stream, problems, world_size: int, datasheet_column: bool = False):
        names = [p.name for p in problems] or ["problem"]
        cases = [case.name for p in problems if world_size in p.world_sizes
                 for kind in ("tests", "benchmarks") for case in p.cases(kind, world_size)]
        self.columns = [("problem", max(map(len, names))), ("case", max(map(len, cases or ["case"]))),
                        ("time us", 12), ("spread", 7), ("busbw GB/s", 11), ("% roofline", 11)]
        self.datasheet_column = datasheet_column  # the profile is calibrated: also against its datasheet
        if datasheet_column:
            self.columns.append(("% datasheet", 12))
        self.columns.append(("bound", 8))
        # A datasheet peak is physical: beating it at all means the cost counts work that is not done. A
        # calibrated peak is itself a measurement: the probe that measured it lands within noise of 100 %.
        self.beaten_above = 1.05 if datasheet_column else 1.0
        self.stream = stream
        self.started = False

    def row(self, row) -> None:
        if not self.started:
            self._print("  ".join(name.ljust(width) for name, width in self.columns))
            self._print("  ".join("-" * width for _, width in self.columns))
            self.started = True
        if row.error:
            cells = [row.problem, row.case, "error", shorten(row.error, 120)]
        else:
            cells = [row.problem, row.case, f"{row.time_us:.1f}",
                     "-" if row.spread is None else f"{row.spread * 100:.1f}%",
                     f"{row.busbw:.3g}" if row.busbw else "-", f"{row.roofline_fraction * 100:.1f}%"]
            if self.datasheet_column:
                fraction = row.datasheet_roofline_fraction
                cells.append("-" if fraction is None else f"{fraction * 100:.1f}%")
            notes = ["timers disagree"] * row.timer_disagreement
            if row.roofline_fraction > self.beaten_above:  # a bound the reference beats is no bound
                notes.append("faster than its bound: check the problem's cost")
            cells.append(row.bound_by + (f" ({'; '.join(notes)})" if notes else ""))
        self._print("  ".join(str(c).ljust(w) for c, (_, w) in zip(cells, self.columns)))

    def _print(self, line: str) -> None:
        print(line.rstrip(), file=self.stream, flush=True)
