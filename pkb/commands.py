"""What the commands that evaluate share (``pkb eval``, ``run``, ``generate``, ``agent``, ``serve``): their
options on the command line, made from pkb.options's one declaration and checked against it as they are parsed
(``add_option``: a value out of range is a usage error, exit 2); the evaluation settings those options resolve to
on this machine (``make_config``, through pkb.evaluate.config.resolve); the options a request to
``pkb serve`` carries (``served_options``); and the executor they run on (``make_executor``). Nothing heavy is
imported until a function runs.
"""

from __future__ import annotations

import argparse
import sys

from pkb.console import UsageError
from pkb.options import (DEFAULT_EXPERIMENT, EVAL_OPTIONS, EXECUTORS, OPTIONS, SERVED_OPTIONS, Option,
                         experiment_complaint)

SELF_CHECK_TRIALS = 1  # `pkb run`'s self-check of each reference, unless --trials says otherwise
# Options whose absence on the command line means something (``None``): `pkb run` lightens the references'
# self-checks unless --trials or --cases is given; --world-size defaults to the problem's.
UNSET_MEANS_DEFAULT = ("world_size", "nodes", "trials", "cases")
_EXTRA_HELP = {
    "trials": f" (default {OPTIONS['trials'].default}; in `pkb run` the references' self-checks run "
              f"{SELF_CHECK_TRIALS} unless --trials is given)",
    "cases": " (default all; in `pkb run` the references' self-checks run their upstream cases unless --cases is given)",
}


def add_option(parser, option: Option, default=None, help: str | None = None) -> None:
    """``option`` as a flag of ``parser`` (its default unless ``default`` is given; its help unless ``help`` is),
    its value checked against the option's row as it is parsed (``checked_type``)."""
    if option.kind is bool:
        parser.add_argument(option.flag, action="store_true", help=help or option.help)
        return
    kwargs = {"type": checked_type(option), "help": (help or option.help) + _EXTRA_HELP.get(option.name, "")}
    if option.choices:
        kwargs["choices"] = list(option.choices)
    parser.add_argument(option.flag, default=default if default is not None or option.name in UNSET_MEANS_DEFAULT
                        else option.default, **kwargs)


def checked_type(option: Option):
    """An argparse ``type`` for ``option``: the text as its kind, refused (argparse's usage error, exit 2) where
    it is out of the option's range, e.g. ``argument --timeout: must be from 1 to 3600, got 0.0``."""
    def parse(text: str):
        try:
            value = option.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes {'an integer' if option.kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        complaint = option.complaint(value)
        if complaint:
            raise argparse.ArgumentTypeError(complaint)
        return value

    parse.__name__ = option.kind.__name__
    parse.option = option  # which row of the table checks it
    return parse


def add_experiment_option(parser, default: str = DEFAULT_EXPERIMENT, help: str | None = None) -> None:
    """``--experiment NAME``: the experiment the command's results are stored under (pkb.options), ``default`` where
    none is given; a name pkb cannot file (empty, a comma) is a usage error."""
    def name(text: str) -> str:
        complaint = experiment_complaint(text)
        if complaint:
            raise argparse.ArgumentTypeError(complaint)
        return text.strip()

    parser.add_argument("--experiment", type=name, default=default, metavar="NAME", help=help or (
        f"the experiment the results are stored under (default {default}); `pkb report --experiment NAME` reports it"))


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
        add_option(parser, OPTIONS["parallel"])


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


def make_config(args, problem=None, executor=None):
    """The evaluation settings of ``args`` for ``problem`` (None: a run over many), resolved by
    pkb.evaluate.config.resolve on ``executor``'s machines (a Ray cluster's largest node) or, without one, this
    machine; a UsageError where they cannot run. The mode and the sandbox candidates get are said on stderr
    (unless ``--json``)."""
    from pkb.evaluate.config import OptionError, resolve

    on_ray = executor is not None and executor.name == "ray"
    try:
        resolved = resolve(option_values(args), problem, executor.gpus_per_node() if executor is not None else None,
                           on_ray=on_ray)
    except OptionError as exc:
        raise UsageError(str(exc)) from None
    if not args.json:
        print(f"mode: {resolved.config.mode} ({resolved.mode_reason})", file=sys.stderr)
        print(f"sandbox: {resolved.sandbox_text}", file=sys.stderr)
    return resolved.config


def make_executor(args):
    """The executor ``--executor`` names (Ray: connected, or a local cluster started), said on stderr."""
    from pkb.executor import make_executor as make

    if args.executor == "local" and args.address is not None:
        raise UsageError("--address is for --executor ray")
    executor = make(args.executor, args.address, args.parallel)
    if not args.json and args.executor != "local":
        print(f"executor: {executor.describe()}", file=sys.stderr)
    return executor
