"""``pkb prompt``, ``pkb generate`` and ``pkb agent``. Nothing heavy (torch, SDKs) is imported until a command runs.

Both take ``--problems`` (a selection: ``1-8,12,allgather_gemm``, a category, ``all``): ``generate`` asks for
k samples of each, ``agent`` holds one conversation per problem, in turn. ``--model replay:DIR`` answers from
a folder of files, offline (pkb.generate.providers.replay_file).

Exit codes: 0 every sample is ``ok`` or ``skipped`` (pkb.options.NO_FAILURE; for the agent: every selected
problem's best file is ``ok``; ``generate --no-eval``: every sample has code); 1 otherwise; 2 a usage error:
unknown provider, missing API key or SDK, a key the server refused, an unknown problem or hardware profile, a
number out of its range, ``--sandbox required`` on a machine that lacks a protection, a ``--db`` pkb cannot
write, all reported before (or instead of) work. The evaluation options (``--mode``, ``--sandbox``, ...) are ``pkb eval``'s
(``pkb.commands.add_eval_options``). In ``cpu`` and ``shared-gpu`` modes the output says that a speedup is not
a GPU timing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pkb.console import shorten
from pkb.options import NO_FAILURE

MESSAGE_CHARS = 200  # of a verdict's message in a sample's row or an agent's step line (the JSON has it whole)


PROBLEMS_HELP = "e.g. 1-8,12,allgather_gemm, a category, or all (slugs or upstream numbers)"


def add_commands(subparsers) -> None:
    from pkb.commands import add_eval_options, add_option, add_precision_option
    from pkb.generate.prompt import BACKENDS, DEFAULT_HARDWARE  # light: templates and dataclasses only
    from pkb.options import OPTIONS

    p = subparsers.add_parser("prompt", help="the prompt a model gets for a problem")
    p.add_argument("problem", help="slug or upstream number")
    p.add_argument("--backend", default="cuda", choices=BACKENDS)
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, help=f"hardware profile (default {DEFAULT_HARDWARE})")
    p.add_argument("--case", help="the case whose per-rank shapes are shown (default: the first benchmark)")
    add_option(p, OPTIONS["world_size"], help="default: the profile's GPU count if the problem runs at it")
    add_option(p, OPTIONS["nodes"])
    add_precision_option(p)
    _add_prompt_options(p)
    p.set_defaults(func=cmd_prompt)

    p = subparsers.add_parser("generate", help="k samples per problem from a model, evaluated and stored")
    _add_model_options(p, BACKENDS, DEFAULT_HARDWARE)
    p.add_argument("--problems", required=True, help=PROBLEMS_HELP)
    add_option(p, OPTIONS["samples"])
    add_option(p, OPTIONS["concurrency"])
    p.add_argument("--no-eval", action="store_true", help="only generate and store the files")
    add_eval_options(p, 2, executor=True)
    p.set_defaults(func=cmd_generate)

    p = subparsers.add_parser("agent", help="multi-turn refinement of each selected problem's solution, with "
                                            "feedback")
    _add_model_options(p, BACKENDS, DEFAULT_HARDWARE)
    p.add_argument("--problems", required=True, help=PROBLEMS_HELP + "; one conversation per problem, in turn")
    add_option(p, OPTIONS["steps"])
    add_eval_options(p, 2, executor=True)
    p.add_argument("--no-perf", dest="perf", action="store_false",
                   help="do not time the files (the agent then cannot tell a faster file from a slower one)")
    p.set_defaults(func=cmd_agent, perf=True)


def _add_prompt_options(p) -> None:
    from pkb.generate.upstream_prompt import PROMPT_KINDS  # light: no torch

    p.add_argument("--prompt", default="pkb", choices=PROMPT_KINDS,
                   help="whose prompt: pkb's own (the default), or the upstream benchmark's, assembled as its kernelgen "
                        "does from a clone given with --upstream-dir (the paper's protocol; docs/generation.md)")
    p.add_argument("--upstream-dir", help="with --prompt upstream: a clone of the upstream benchmark's repository "
                                          "(kernelgen/prompts.toml, its example files, reference/)")


def _upstream_dir(args) -> Path | None:
    """``--upstream-dir``, checked against ``--prompt``."""
    if args.prompt == "upstream" and not args.upstream_dir:
        raise _usage("--prompt upstream needs --upstream-dir DIR, a clone of the upstream benchmark's repository")
    if args.prompt != "upstream" and args.upstream_dir:
        raise _usage("--upstream-dir goes with --prompt upstream")
    return Path(args.upstream_dir) if args.upstream_dir else None


def _add_model_options(p, backends, default_hardware) -> None:
    from pkb.commands import add_experiment_option, add_option
    from pkb.options import OPTIONS

    p.add_argument("--model", required=True, help="provider:model, e.g. openai:gpt-5, anthropic:claude-sonnet-4-5, "
                                                   "together:Qwen/Qwen3-Coder-480B-A35B-Instruct-FP8, vllm:my-model; "
                                                   "replay:DIR answers with the files of DIR, offline "
                                                   "(docs/generation.md)")
    p.add_argument("--backend", default="cuda", choices=backends)
    p.add_argument("--hardware", default=default_hardware, help="hardware profile the prompt describes")
    add_option(p, OPTIONS["temperature"])
    add_option(p, OPTIONS["max_tokens"])
    p.add_argument("--run", help="run name (default from model, backend, temperature and, outside cuda mode, the "
                                 "mode: openai-gpt-5-cuda-on-cpu); a rerun resumes it")
    p.add_argument("--out", default=None, help="directory for the run's files (default ./pkb-runs)")
    p.add_argument("--db", help="SQLite file (default: ./pkb-results.sqlite)")
    add_experiment_option(p)
    add_option(p, OPTIONS["request_timeout"])
    add_option(p, OPTIONS["retries"])
    p.add_argument("--base-url", help="endpoint URL, overriding the provider's default and its *_BASE_URL variable")
    p.add_argument("--price", help="USD per million tokens IN,OUT, for a model the price table lacks")
    _add_prompt_options(p)


# -- commands ---------------------------------------------------------------------------------------


def cmd_prompt(args) -> int:
    from pkb.generate.prompt import load_profile
    from pkb.generate.upstream_prompt import prompt_for
    from pkb.registry import get_problem

    problem = get_problem(args.problem)
    if args.world_size is not None and args.world_size not in problem.world_sizes:
        raise _usage(f"{problem.name} runs at world sizes {list(problem.world_sizes)}; pick one with --world-size")
    upstream_dir = _upstream_dir(args)
    with _usage_errors():
        profile = load_profile(args.hardware)
        case = problem.find_case(args.case) if args.case else None
        print(prompt_for(problem, args.backend, profile, args.world_size, args.prompt, upstream_dir, case, args.dtype,
                         args.nodes))
    return 0


def cmd_generate(args) -> int:
    from pkb.commands import make_config
    from pkb.console import print_table
    from pkb.generate.prompt import load_profile
    from pkb.generate.sampler import DEFAULT_OUT, GenerateSettings, generate
    from pkb.generate.providers import ProviderError
    from pkb.registry import select
    from pkb.store.db import DEFAULT_DB, ResultStore, check_store

    provider = _connect(args)  # first: a missing key or SDK stops here, before any work
    problems = select(args.problems)
    with _usage_errors():
        profile = load_profile(args.hardware)
    upstream_dir = _upstream_dir(args)
    progress = _progress(len(problems) * args.samples, enabled=not args.json)
    db = args.db or DEFAULT_DB
    check_store(db)  # a --db it cannot store results in: said before any work, nothing written
    with _executor(args, enabled=not args.no_eval) as executor, _usage_errors(ProviderError):
        config = None if args.no_eval else make_config(args, executor=executor)
        settings = GenerateSettings(run=_run_name(args, provider, config), prompt=args.prompt,
                                    upstream_dir=upstream_dir, precision=args.dtype, backend=args.backend,
                                    hardware=args.hardware, num_samples=args.samples, temperature=args.temperature,
                                    max_tokens=args.max_tokens, concurrency=args.concurrency,
                                    out_dir=Path(args.out or DEFAULT_OUT), experiment=args.experiment)
        with ResultStore(db) as store:
            results = generate(problems, provider, settings, store, profile, config, progress, executor)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], default=str))
    else:
        print_table([_sample_row(r) for r in results], ["problem", "sample", "status", "speedup", "tokens", "cost",
                                                        "message"])
        print(_summary(results, settings.run_dir, db))
        if any(r.speedup for r in results) and _not_gpu_timings(config):
            print(_not_gpu_timings(config))
    wanted = ("generated",) if args.no_eval else NO_FAILURE
    return 0 if all(r.status in wanted for r in results) else 1


def cmd_agent(args) -> int:
    from pkb.commands import make_config
    from pkb.generate.agent import AgentSettings, run_agent
    from pkb.generate.prompt import load_profile
    from pkb.generate.providers import ProviderError
    from pkb.generate.sampler import DEFAULT_OUT
    from pkb.registry import select
    from pkb.store.db import DEFAULT_DB, ResultStore, check_store

    provider = _connect(args)
    problems = select(args.problems)
    with _usage_errors():
        profile = load_profile(args.hardware)
    upstream_dir = _upstream_dir(args)
    outcomes = []
    check_store(args.db or DEFAULT_DB)
    with _executor(args) as executor, _usage_errors(ProviderError):
        config = make_config(args, executor=executor)  # a problem without that size runs at its smallest
        run = _run_name(args, provider, config, prefix="agent-")
        settings = AgentSettings(run=run, prompt=args.prompt, upstream_dir=upstream_dir, precision=args.dtype,
                                 backend=args.backend, hardware=args.hardware, num_steps=args.steps,
                                 temperature=args.temperature, max_tokens=args.max_tokens,
                                 out_dir=Path(args.out or DEFAULT_OUT), experiment=args.experiment)
        not_gpu = "" if config.mode.times_are_gpu_performance else f" ({config.mode} mode: not a GPU timing)"

        def show(step) -> None:
            if not args.json:
                speed = f", speedup {step.speedup:.2f}x{not_gpu}" if step.speedup else ""
                earlier = " (stored earlier)" if step.resumed else ""
                print(f"{problem.name} step {step.step}: {step.status}{speed}{earlier}"
                      + (f"  {shorten(step.message, MESSAGE_CHARS)}" if step.status != "ok" else ""), file=sys.stderr)

        with ResultStore(args.db or DEFAULT_DB) as store:
            for problem in problems:
                outcomes.append(run_agent(problem, provider, settings, store, profile, config, show, executor))
                if outcomes[-1].stopped_by:
                    print(f"pkb: {problem.name} stopped at {outcomes[-1].stopped_by}", file=sys.stderr)
    if args.json:
        print(json.dumps([outcome.to_dict() for outcome in outcomes], default=str))
    else:
        for outcome in outcomes:
            if outcome.best_step is None:
                print(f"{outcome.problem}: no correct file in {len(outcome.steps)} steps")
            else:
                speed = f", speedup {outcome.best_speedup:.2f}x" if outcome.best_speedup else ""
                print(f"{outcome.problem}: best file from step {outcome.best_step}{speed}: {outcome.best_path}")
        costs = [outcome.cost_usd for outcome in outcomes]
        cost = f", ${sum(costs):.4f}" if None not in costs else ""
        print(f"{sum(len(outcome.steps) for outcome in outcomes)} steps{cost}; transcript in {args.db or DEFAULT_DB} "
              f"(run {run})")
        if any(outcome.best_speedup for outcome in outcomes) and _not_gpu_timings(config):
            print(_not_gpu_timings(config))
    return 0 if all(outcome.best_step is not None for outcome in outcomes) else 1


def _not_gpu_timings(config) -> str:
    """A line saying the speedups printed above are not GPU timings, where the mode's times are not."""
    if config is None or config.mode.times_are_gpu_performance:
        return ""
    return (f"(speedups measured in {config.mode} mode are not GPU timings: reference and candidate were timed "
            "the same way here, but only --mode cuda times them on GPUs)")


# -- pieces -----------------------------------------------------------------------------------------


def _run_name(args, provider, config, prefix: str = "") -> str:
    """``--run``, or ``prefix`` and the name that says what ran (pkb.generate.sampler.default_run_name): the files
    judged in ``config``'s mode; with ``--no-eval``, the mode named by ``--mode`` (so that a later run that judges
    them in that mode finds them), else none."""
    from pkb.generate.sampler import default_run_name

    named = getattr(args, "mode", None)
    mode = config.mode if config else (named if named not in (None, "auto") else None)
    return args.run or prefix + default_run_name(provider.spec, args.backend, mode, args.temperature)


def _executor(args, enabled: bool = True):
    """The ``--executor`` the evaluations run on (this machine's when ``enabled`` is false: nothing to run)."""
    from pkb.commands import make_executor
    from pkb.executor import LocalExecutor

    return make_executor(args) if enabled else LocalExecutor()


def _connect(args):
    from pkb.generate.providers import ModelSpec, ProviderSettings, SetupError, connect

    with _usage_errors(SetupError):
        price = _parse_price(args.price) if args.price else None
        settings = ProviderSettings(timeout_s=args.request_timeout, max_retries=max(args.retries, 0),
                                    base_url=args.base_url, price_per_mtok=price)
        return connect(ModelSpec.parse(args.model), settings)


def _parse_price(text: str) -> tuple[float, float]:
    try:
        price_in, price_out = (float(part) for part in text.split(","))
    except ValueError:
        raise _usage(f"--price {text!r}: write USD per million input and output tokens, e.g. --price 3,15") from None
    return price_in, price_out


def _usage(message: str) -> Exception:
    from pkb.console import UsageError

    return UsageError(message)


class _usage_errors:
    """Turn the given exceptions (default: the prompt's and the provider's setup errors) into UsageError."""

    def __init__(self, *kinds):
        self.kinds = kinds

    def __enter__(self):
        if not self.kinds:
            from pkb.generate.prompt import PromptError
            from pkb.generate.providers import SetupError

            self.kinds = (PromptError, SetupError)
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None and issubclass(kind, self.kinds):
            raise _usage(str(exc)) from None
        return False


def _progress(total: int, enabled: bool):
    done = [0]

    def update(result) -> None:
        done[0] += 1
        if enabled:
            label = f"{result.problem}/sample {result.sample}: {result.status}" + (" (stored earlier)" if result.resumed else "")
            print(f"[{done[0]}/{total}] {label}", file=sys.stderr, flush=True)

    return update


def _sample_row(result) -> dict:
    tokens = f"{result.tokens_in}/{result.tokens_out}" if result.tokens_in is not None else ""
    return {"problem": result.problem, "sample": result.sample, "status": result.status,
            "speedup": f"{result.speedup:.2f}" if result.speedup else "", "tokens": tokens,
            "cost": f"{result.cost_usd:.4f}" if result.cost_usd is not None else "",
            "message": shorten(result.message, MESSAGE_CHARS)}


def _summary(results, run_dir: Path, db: str) -> str:
    from pkb.generate.sampler import UNANSWERED

    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    fresh = [r for r in results if not r.resumed]
    answered = [r for r in fresh if r.status not in UNANSWERED]  # an API error or a missing replay file is no answer
    tokens_in = sum(r.tokens_in or 0 for r in fresh)
    tokens_out = sum(r.tokens_out or 0 for r in fresh)
    costs = [r.cost_usd for r in answered]
    cost = "unknown cost" if None in costs else f"${sum(costs):.4f}"
    unanswered = len(fresh) - len(answered)
    return (f"\n{len(results)} samples: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            + f"\nthis call: {len(answered)} model answers" + (f" ({unanswered} asked, no answer)" if unanswered else "")
            + f", {tokens_in} tokens in, {tokens_out} out, {cost}"
            + f"\nfiles in {run_dir}, rows in {db}")
