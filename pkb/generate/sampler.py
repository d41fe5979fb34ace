"""``pkb generate``: k samples per problem from one model, each extracted, written, evaluated, recorded.

For each problem and sample: build the prompt, call the model (several calls in flight, up to the
concurrency limit), extract the solution, write it under ``<out>/<run>/<problem>/sample_<k>.py``,
evaluate it (on the executor given: this machine by default, or a Ray cluster, where evaluations run
while the model is still answering), and store the prompt, the raw
response, the code, tokens, cost and the verdict (``generations`` rows linked to ``results``).

A rerun of the same run name skips what is done: a sample with a verdict (or with code, under
``--no-eval``) is not asked again; a sample whose call failed is asked again; a sample generated
under ``--no-eval`` is evaluated from its stored code without calling the model. Identical files
are evaluated once (the results table is keyed by the file's hash and the evaluation settings).
"""

from __future__ import annotations

import enum
import hashlib
import re
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from pkb.generate.extract import extract_solution
from pkb.generate.prompt import DEFAULT_HARDWARE, Prompt
from pkb.generate.upstream_prompt import prompt_for
from pkb.generate.providers import (CallContext, Completion, Message, ModelSpec, NoReplayFile, Provider,
                                    ProviderError)
from pkb.options import DEFAULT_EXPERIMENT
from pkb.problem import Problem
from pkb.store.db import generated_set

DEFAULT_OUT = "pkb-runs"


class GenStatus(str, enum.Enum):
    """A sample's state before (or instead of) a verdict; once evaluated, its status is the verdict."""

    GENERATED = "generated"  # code extracted, not evaluated (--no-eval)
    NO_CODE = "no_code"  # the answer held no code block defining `solution`; not evaluated
    API_ERROR = "api_error"  # the model call failed after its retries; a rerun asks again
    NO_REPLAY_FILE = "no_replay_file"  # replay:DIR holds no file for the call (the message names it); asked again

    def __str__(self) -> str:
        return self.value


UNANSWERED = (GenStatus.API_ERROR, GenStatus.NO_REPLAY_FILE)  # no answer came, nothing cost: a rerun asks again


@dataclass(frozen=True)
class RunSettings:
    """What a generation run (``pkb generate``) and a refinement run (``pkb agent``) both set."""

    run: str
    backend: str = "cuda"
    hardware: str = DEFAULT_HARDWARE
    temperature: float | None = None
    max_tokens: int = 16384
    out_dir: Path = Path(DEFAULT_OUT)
    world_size: int | None = None  # the world size the prompt describes (default: the profile's GPUs)
    prompt: str = "pkb"  # whose prompt: pkb's, or the upstream benchmark's (built from ``upstream_dir``)
    upstream_dir: Path | None = None
    precision: str | None = None  # the run's precision (--dtype; None: bf16): the prompt states it
    experiment: str = DEFAULT_EXPERIMENT  # the experiment its results are stored under (--experiment)

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.run


@dataclass(frozen=True)
class GenerateSettings(RunSettings):
    num_samples: int = 1
    concurrency: int = 4


@dataclass(frozen=True)
class SampleResult:
    """One sample's outcome: a row of ``pkb generate --json``."""

    problem: str
    sample: int
    status: str
    code_path: str | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    cost_usd: float | None = None
    latency_s: float | None = None
    speedup: float | None = None
    message: str = ""
    resumed: bool = False
    generation_id: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def default_run_name(model: ModelSpec, backend: str, mode: str | None, temperature: float | None) -> str:
    """A directory-safe name that says what ran: the model, the kernels it was asked for (``backend``; none for
    ``replay:DIR``, whose files answer whatever is asked), its temperature where set, and the mode its files were
    judged in where that is not ``cuda`` (``mode`` None: not judged, ``--no-eval``). E.g. ``openai-gpt-5-cuda``,
    ``together-Qwen-Qwen3-Coder-triton-t0.8``, ``openai-gpt-5-cuda-on-cpu``, ``replay-answers-on-cpu``."""
    parts = [str(model)] + ([] if model.replays else [backend])
    if temperature is not None:
        parts.append(f"t{temperature:g}")
    if mode not in (None, "cuda"):
        parts.append(f"on-{mode}")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(parts)).strip("-")


def judged_world_size(problem: Problem, config) -> int:
    """The world size ``problem`` is judged at under ``config``: the run's, where the problem runs at it, else the
    problem's smallest."""
    return config.world_size if config.world_size in problem.world_sizes else min(problem.world_sizes)


def prompt_world_size(problem: Problem, settings: RunSettings, eval_config) -> int | None:
    """The world size ``problem``'s prompt describes: the settings', else the one its answers are judged at (a new
    user's walk, issue 54: `--world-size 2` judged on 2 ranks what a prompt for the profile's 8 had asked for), else
    None (the profile's GPUs: pkb.generate.prompt.build_prompt)."""
    return settings.world_size or (judged_world_size(problem, eval_config) if eval_config is not None else None)


def generate(problems: list[Problem], provider: Provider, settings: GenerateSettings, store, profile,
             eval_config=None, on_result: Callable[[SampleResult], None] = lambda result: None,
             executor=None) -> list[SampleResult]:
    """Run ``settings.num_samples`` samples of every problem; ``eval_config`` None means do not evaluate.
    ``executor`` (pkb.executor) runs the evaluations; default: this machine, one after another.

    Raises ProviderError when the provider fails in a way every call would (bad key, unknown model,
    unreachable server); what finished before is stored (a sample whose evaluation had not finished
    keeps its code, and a rerun evaluates it).
    """
    verdicts = VerdictQueue(store, eval_config, executor, settings.experiment) if eval_config is not None else None
    results: list[SampleResult] = []

    def finish(result: SampleResult) -> None:
        results.append(result)
        on_result(result)

    try:
        calls = []
        for problem in problems:
            prompt = prompt_for(problem, settings.backend, profile, prompt_world_size(problem, settings, eval_config),
                                settings.prompt, settings.upstream_dir, precision=settings.precision)
            for sample in range(settings.num_samples):
                row = _latest_row(store, settings.run, problem, sample)
                if row is not None and row["status"] == GenStatus.GENERATED and verdicts is not None:
                    _evaluate_row(row, problem, settings, store, verdicts, finish)
                elif row is not None and row["status"] not in UNANSWERED:
                    finish(_from_row(row, resumed=True))
                else:
                    calls.append((problem, prompt, sample))
        _call_all(calls, provider, settings, lambda problem, prompt, sample, answer:
                  _record(problem, prompt, sample, answer, provider, settings, store, verdicts, finish))
        if verdicts is not None:
            verdicts.collect(wait=True)
    finally:
        if verdicts is not None:
            verdicts.close()
    order = {p.name: i for i, p in enumerate(problems)}
    return sorted(results, key=lambda r: (order[r.problem], r.sample))


def _call_all(calls: list, provider: Provider, settings: GenerateSettings, handle: Callable) -> None:
    """Call the model for every (problem, prompt, sample), up to ``concurrency`` at once, and hand each
    answer (a Completion or a ProviderError) to ``handle`` in this thread, as it arrives. After a fatal
    error no new call starts."""
    pool = ThreadPoolExecutor(max_workers=max(1, settings.concurrency), thread_name_prefix="pkb-model")
    stop = threading.Event()
    pending: dict[Future, tuple] = {}
    try:
        for problem, prompt, sample in calls:
            future = pool.submit(_ask, provider, prompt, settings, stop, CallContext(problem.name, problem.upstream_id,
                                                                                     sample=sample))
            pending[future] = (problem, prompt, sample)
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: pending[f][2]):
                problem, prompt, sample = pending.pop(future)
                answer = future.result()
                if answer is None:  # not asked: a fatal error came first
                    continue
                handle(problem, prompt, sample, answer)
                if isinstance(answer, ProviderError) and answer.fatal:
                    raise answer
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _ask(provider: Provider, prompt: Prompt, settings: GenerateSettings, stop: threading.Event,
         context: CallContext) -> Completion | ProviderError | None:
    if stop.is_set():
        return None
    try:
        return provider.complete(prompt.system, [Message("user", prompt.user)], settings.max_tokens,
                                 settings.temperature, context)
    except ProviderError as exc:
        if exc.fatal:
            stop.set()
        return exc


def _record(problem: Problem, prompt: Prompt, sample: int, answer: Completion | ProviderError, provider: Provider,
            settings: GenerateSettings, store, verdicts: "VerdictQueue | None",
            finish: Callable[[SampleResult], None]) -> None:
    row = generation_row(problem, prompt, provider, settings, kind="sample", sample=sample, step=0, answer=answer)
    if row["code"] is not None:
        row["code_path"] = str(write_code(settings.run_dir / problem.name / f"sample_{sample}.py", row["code"]))
    row["id"] = store.add_generation(row)
    if row["status"] == GenStatus.GENERATED and verdicts is not None:
        _evaluate_row(row, problem, settings, store, verdicts, finish)
        verdicts.collect(wait=False)  # finished evaluations are stored while the model still answers
    else:
        finish(_from_row(row, resumed=False))


def generation_row(problem: Problem, prompt: Prompt, provider: Provider, settings, kind: str, sample: int, step: int,
                   answer: Completion | ProviderError, user_message: str | None = None) -> dict:
    """The ``generations`` row for one model call, before evaluation (status generated, no_code, api_error or
    no_replay_file)."""
    row = dict(run=settings.run, kind=kind, model=str(provider.spec), provider=provider.spec.provider,
               problem=problem.name, problem_version=problem.version, sample=sample, step=step,
               backend=prompt.backend, hardware=prompt.hardware, world_size=prompt.world_size, case_name=prompt.case,
               temperature=settings.temperature, max_tokens=settings.max_tokens, system=prompt.system,
               prompt_kind=prompt.kind, precision=prompt.precision,
               prompt=user_message if user_message is not None else prompt.user, code=None, code_path=None,
               code_sha256=None)
    if isinstance(answer, ProviderError):
        status = GenStatus.NO_REPLAY_FILE if isinstance(answer, NoReplayFile) else GenStatus.API_ERROR
        return {**row, "status": status.value, "error": str(answer), "attempts": answer.attempts}
    row.update(response=answer.text, tokens_in=answer.tokens_in, tokens_out=answer.tokens_out,
               cost_usd=answer.cost_usd, latency_s=answer.latency_s, attempts=answer.attempts)
    extraction = extract_solution(answer.text)
    if extraction is None:
        return {**row, "status": GenStatus.NO_CODE.value,
                "error": "no code block defining `solution`" + (f" (finish reason: {answer.finish_reason})"
                                                                 if answer.finish_reason else "")}
    return {**row, "status": GenStatus.GENERATED.value, "code": extraction.code,
            "code_sha256": hashlib.sha256(extraction.code.encode()).hexdigest(),
            "error": f"syntax error: {extraction.syntax_error}" if extraction.syntax_error else None}


def write_code(path: Path, code: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(code, encoding="utf-8")
    return path.resolve()


def _evaluate_row(row: dict, problem: Problem, settings: GenerateSettings, store, verdicts: "VerdictQueue",
                  finish: Callable[[SampleResult], None]) -> None:
    """Submit the row's file for evaluation; ``finish`` gets the sample's result once its verdict is stored."""
    path = Path(row["code_path"] or settings.run_dir / problem.name / f"sample_{row['sample']}.py")
    if not path.is_file() or path.read_text(encoding="utf-8") != row["code"]:
        write_code(path, row["code"])  # the database holds the code; the file is a copy

    def judged(result, result_id, key) -> None:
        store.set_generation_verdict(row["id"], result.status.value, result_id, key, result.speedup)
        finish(replace(_from_row(row, resumed=False), status=result.status.value, speedup=result.speedup,
                       message=result.message, code_path=str(path)))

    verdicts.submit(problem, path, f"{settings.run}/{path.stem}", generated_set(row["model"], settings.run), judged)


def _latest_row(store, run: str, problem: Problem, sample: int) -> dict | None:
    rows = [r for r in store.generations(run=run, problem=problem.name)
            if r["sample"] == sample and r["step"] == 0 and r["kind"] == "sample"
            and r["problem_version"] == problem.version]
    return rows[-1] if rows else None


def _from_row(row: dict, resumed: bool) -> SampleResult:
    return SampleResult(problem=row["problem"], sample=row["sample"], status=row["status"], code_path=row.get("code_path"),
                        tokens_in=row.get("tokens_in"), tokens_out=row.get("tokens_out"), cost_usd=row.get("cost_usd"),
                        latency_s=row.get("latency_s"), speedup=row.get("speedup"), message=row.get("error") or "",
                        resumed=resumed, generation_id=row.get("id"))


@dataclass
class VerdictQueue:
    """Generated files in, verdicts out: submits each file to pkb's evaluation loop (pkb.loop.EvaluationLoop, which
    evaluates it on an executor, pkb.executor; default: this machine, and stores the result) and hands each stored
    verdict back to the sample that waits for it. A file already judged with the same settings (same run key, a
    verdict) is not judged again, and keeps the row it was first stored under (reports take a generated result's
    set from the generation that links to it)."""

    store: object
    config: object  # pkb.evaluate.config.EvalConfig
    executor: object = None  # pkb.executor.Executor; None: a LocalExecutor owned (and closed) by the loop
    experiment: str = DEFAULT_EXPERIMENT  # the experiment every result is stored under

    def __post_init__(self):
        from pkb.loop import EvaluationLoop

        self.loop = EvaluationLoop(self.store, self.config, self.executor, reuse="as_stored")

    def submit(self, problem: Problem, path: Path, name: str, solution_set: str, done: Callable) -> None:
        """Evaluate the file at ``path``, stored under ``solution_set``; ``done(result, row id, run key)``
        once it is stored (at the next ``collect`` where an earlier verdict is reused)."""
        from pkb.evaluate.candidate import Candidate
        from pkb.executor import Evaluation

        config = replace(self.config, world_size=judged_world_size(problem, self.config))
        self.loop.submit(Evaluation(problem, Candidate.from_file(path, name=name), solution_set, config, tag=done,
                                    experiment=self.experiment))

    def collect(self, wait: bool) -> None:
        """Hand the evaluations that have finished (``wait``: all of them) to their ``done``."""
        for stored in self.loop.finished(wait=wait):
            stored.evaluation.tag(stored.result, stored.result_id, stored.key)

    def verdict_of(self, problem: Problem, path: Path, name: str, solution_set: str = ""):
        """(EvalResult, results row id, run key) of the file at ``path``, waited for."""
        if self.loop.pending:
            raise RuntimeError("verdict_of() waits for one evaluation; others are still pending")
        outcome = []
        self.submit(problem, path, name, solution_set, lambda *judged: outcome.append(judged))
        self.collect(wait=True)
        return outcome[0]

    def close(self) -> None:
        self.loop.close()
