"""What the commands that evaluate share (``pkb eval``, ``run``, ``generate``, ``agent``, ``serve``): their
options on the command line, made from pkb.options's one declaration; the evaluation settings those
options resolve to on this machine (``make_config``); the options a request to ``pkb serve`` carries
(``served_options``); and the executor they run on (``make_executor``). Nothing heavy is imported until
a function runs.
"""

from __future__ import annotations

import sys

from pkb.console import UsageError
from pkb.options import EVAL_OPTIONS, EXECUTORS, OPTIONS, SERVED_OPTIONS, Option

SELF_CHECK_TRIALS = 1  # `pkb run`'s self-check of each reference, unless --trials says otherwise
# Options whose absence on the command line means something (``None``): `pkb run` lightens the references'
# self-checks unless --trials or --cases is given; --world-size defaults to the problem's.
UNSET_MEANS_DEFAULT = ("world_size", "nodes", "trials", "cases")
_EXTRA_HELP = {
    "trials": f" (default {OPTIONS['trials'].default}; in `pkb run` the references' self-checks run "
              f"{SELF_CHECK_TRIALS} unless --trials is given)",
    "cases": " (default all; in `pkb run` the references' self-checks run their upstream cases unless --cases is given)",
}


def add_option(parser, option: Option, default=None) -> None:
    """``option`` as a flag of ``parser`` (its default unless ``default`` is given)."""
    if option.kind is bool:
        parser.add_argument(option.flag, action="store_true", help=option.help)
        return
    kwargs = {"type": option.kind, "help": option.help + _EXTRA_HELP.get(option.name, "")}
    if option.choices:
        kwargs["choices"] = list(option.choices)
    parser.add_argument(option.flag, default=default if default is not None or option.name in UNSET_MEANS_DEFAULT
                        else option.default, **kwargs)


def add_precision_option(parser) -> None:
    add_option(parser, OPTIONS["dtype"])


def add_eval_options(parser, world_size_default, executor: bool = False) -> None:
    """Every evaluation option (pkb.options.EVAL_OPTIONS), ``--json``, and with ``executor`` where to run."""
    for option in EVAL_OPTIONS:
        add_option(parser, option, world_size_default if option.name == "world_size" else None)
    parser.add_argument("--json", action="store_true")
    if executor:
        parser.add_argument("--executor", default="local", choices=EXECUTORS,
                            help="where evaluations run: this machine (default), or a Ray cluster: one evaluation per "
                                 "node slot, results stored here as they finish (pip install 'pkb[ray]'; docs/cluster.md)")
        parser.add_argument("--address", help="with --executor ray: auto (the cluster this machine is in), "
                                              "ray://HOST:PORT, or local (a new cluster on this machine; the default "
                                              "unless RAY_ADDRESS is set)")
        parser.add_argument("--parallel", type=int,
                            help="at most this many evaluations at once (default: as many as this machine holds, by its "
                                 "cores, memory and GPU memory at the run's world size; on Ray, as many as the cluster's "
                                 "nodes hold). Timed evaluations (--perf) always run alone, after the untimed ones")


def option_values(args) -> dict:
    """The evaluation options as ``args`` set them, by name, the unset ones at their defaults."""
    return {option.name: option.default if getattr(args, option.name) is None else getattr(args, option.name)
            for option in EVAL_OPTIONS}


def served_options(args) -> dict:
    """The options of ``args`` that a request to ``pkb serve`` carries (pkb.options.EvaluationRequest); the
    others are the server's to choose, and set away from their defaults they are a usage error."""
    values = option_values(args)
    kept = {name: values[name] for name in SERVED_OPTIONS if values[name] is not None}
    own = [OPTIONS[name].flag for name in values if name not in SERVED_OPTIONS and values[name] != OPTIONS[name].default]
    if own:
        raise UsageError(f"{' and '.join(own)} {'are' if len(own) > 1 else 'is'} the server's to choose "
                         "(`pkb serve --sandbox`)")
    return kept


def make_config(args, world_size: int, executor=None):
    """The evaluation settings of ``args``; ``--mode auto`` decides by the GPUs of ``executor``'s machines
    (a Ray cluster's largest node) or, without one, of this machine. The mode and the sandbox candidates
    get are said on stderr (unless ``--json``)."""
    from pkb.evaluate.config import EvalConfig
    from pkb.runtime.modes import ModeUnavailable, choose_mode

    values = option_values(args)
    gpus = executor.gpus_per_node() if executor is not None else None
    try:
        choice = choose_mode(values["mode"], world_size, num_gpus=gpus)
    except ModeUnavailable as exc:
        raise UsageError(str(exc) + (" (GPUs counted on the largest node of the Ray cluster)" if gpus is not None else "")) from None
    sandbox = sandbox_line(values["sandbox"], choice.mode, on_ray=executor is not None and executor.name == "ray")
    if not args.json:
        print(f"mode: {choice.mode} ({choice.reason})", file=sys.stderr)
        print(f"sandbox: {sandbox}", file=sys.stderr)
    try:
        return EvalConfig(world_size=world_size, nodes=values["nodes"] or 0, mode=choice.mode, num_trials=values["trials"],
                          timeout_s=values["timeout"], perf=values["perf"], cuda_graph=values["cuda_graph"],
                          policy=values["policy"], cases=values["cases"], sandbox=values["sandbox"],
                          precision=values["dtype"], upstream_trials=values["upstream_trials"])
    except ValueError as exc:  # e.g. --nodes that does not divide --world-size
        raise UsageError(f"{exc}: pick --nodes that divides --world-size") from None


def sandbox_line(level: str, mode, on_ray: bool = False) -> str:
    """What ``--sandbox level`` gives candidates here, e.g. ``auto (full: landlock-fs, ...)``; on a Ray
    cluster each node checks for itself (a node that cannot honour ``required`` ends its tasks as
    ``infra_error``). Raises UsageError where ``required`` cannot be honoured on this machine."""
    from pkb.runtime.sandbox import SandboxStatus, SandboxUnavailable, check_sandbox

    if level == "off":
        return SandboxStatus.off().describe()
    if on_ray:
        return f"{level} (checked on each node of the Ray cluster)"
    try:
        status = check_sandbox(level, mode)
    except SandboxUnavailable as exc:
        raise UsageError(str(exc)) from None
    return status.describe()


def make_executor(args):
    """The executor ``--executor`` names (Ray: connected, or a local cluster started), said on stderr."""
    from pkb.executor import make_executor as make

    if args.executor == "local" and args.address is not None:
        raise UsageError("--address is for --executor ray")
    if args.parallel is not None and args.parallel < 1:
        raise UsageError("--parallel must be at least 1")
    executor = make(args.executor, args.address, args.parallel)
    if not args.json and args.executor != "local":
        print(f"executor: {executor.describe()}", file=sys.stderr)
    return executor
