"""A ``verifiers`` environment whose reward is pkb's verdict, judged by a running ``pkb serve``.

For verifiers 0.4 (``import verifiers.v1 as vf``; ``pip install 'pkb[rl]'``); docs/rl.md.

    from pkb.rl.verifiers_env import load_environment
    env = load_environment("http://127.0.0.1:PORT", categories=["collectives"], world_size=2, max_turns=3)

- **Dataset**: the suite's prompts, what ``pkb prompt`` builds, read from the service
  (``GET /v1/problems/{id}/prompt``), one task per problem that runs at the world size and precision
  asked, chosen by problem and category; the backend (cuda, triton) is the one the prompt asks for.
- **Rollout**: one conversation. The model answers the prompt; pkb's extractor (pkb.generate.extract)
  takes the file from the answer and the service judges it (``pkb.client``: no torch in this process).
  With ``max_turns > 1`` the verdict is the next user message, the one ``pkb agent`` sends
  (pkb.generate.prompt.feedback), until the file is correct or the turns run out.
- **Rewards**, each also a metric, all on the last answer's verdict (0 unless pkb's strict verdict is ok):
  ``correctness`` (1 when ok), ``fast_1`` (faster than the reference), ``log_speedup``
  (clip(log2(speedup), 0, cap) / cap) and ``roofline_fraction`` (of the hardware roofline); the last
  three need timings (``perf=True``). Weights: correctness 1, the others 0, or 1 with ``perf=True``.

Each answer is evaluated once (again only after no verdict): the verdict is kept on the rollout's state
(``trace.state.verdict``, the JSON of ``pkb eval --json``) and every reward reads it there. Only a verdict
that is no verdict on the file (``harness_error``, ``infra_error``: pkb or its executor saw itself fail) is
asked for again, up to ``no_verdict_retries`` times; after that the answer scores 0, the reason in its
verdict's message. Every status a candidate can cause (``skipped`` too) scores as a failure. The metric
``upstream_ok`` (the paper's verdict) is left out of a trace's metrics where it was not checked, rather than
read as a 0.

verifiers loads a taskset by the id of an installed module: this one's is ``pkb-verifiers`` (the package
``pkb_verifiers``, which re-exports this module), so ``vf-eval pkb-verifiers`` and an env server that
builds the environment from its config in a new process find it.
"""

from __future__ import annotations

import asyncio
from typing import Any

try:
    import httpx
    import verifiers.v1 as vf
    from pydantic import Field
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.errors import MODEL_TRANSPORT_ERROR_EXIT_CODE
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(f"pkb's verifiers environment needs verifiers 0.4: pip install 'pkb[rl]' ({exc})") from None

from pkb.client import Client
from pkb.generate.prompt import BACKENDS
from pkb.options import request_options
from pkb.protocol import DEFAULT_PRECISION
from pkb.rl import common
from pkb.rl.common import NO_VERDICT_RETRIES, rewards

TASKSET_ID = "pkb-verifiers"
REWARDS = tuple(name for name in common.REWARDS if name != "upstream_ok")  # the paper's verdict: a metric

# -- configs -------------------------------------------------------------------------------------------


class PkbTaskConfig(vf.TaskConfig):
    """How answers are judged: the service, and the options of ``pkb eval`` (None: the service's default)."""

    server_url: str | None = None
    """``pkb serve``'s URL; default $PKB_SERVE_URL. The token, if the server wants one: $PKB_SERVE_TOKEN."""
    mode: str = "cpu"
    cases: str | None = None
    trials: int | None = None
    upstream_trials: int | None = None
    perf: bool = False
    policy: str | None = None
    timeout: float | None = None
    solution_set: str = "rl"
    """The solution set the service stores each verdict under."""
    log_speedup_cap: float = Field(3.0, gt=0)
    """``log_speedup`` reaches 1 at 2**cap times the reference's speed (3: 8x)."""
    no_verdict_retries: int = Field(NO_VERDICT_RETRIES, ge=0)
    """Evaluations again of a file that got no verdict (``harness_error``, ``infra_error``) before it scores 0."""

    def eval_options(self) -> dict[str, Any]:
        return request_options(mode=self.mode, cases=self.cases, trials=self.trials, perf=self.perf,
                               upstream_trials=self.upstream_trials, policy=self.policy, timeout=self.timeout,
                               solution_set=self.solution_set)

    def client(self) -> Client:
        return common.client(self.server_url)


class PkbTasksetConfig(vf.TasksetConfig):
    """Which prompts: problems (slugs or numbers) and categories (None: all), at one world size and precision."""

    id: str = TASKSET_ID
    problems: list[str] | None = None
    categories: list[str] | None = None
    world_size: int = 2
    backend: str = "cuda"
    dtype: str = DEFAULT_PRECISION
    hardware: str | None = None
    """The hardware profile the prompt describes (None: pkb prompt's default)."""
    task: PkbTaskConfig = PkbTaskConfig()


class PkbEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    """The policy's seat; its harness (PkbHarness) runs in this process, nothing runs in the runtime."""
    max_turns: int = Field(1, ge=1)
    """Answers per rollout: 1 is single-turn; more sends each verdict back until the file is correct."""


# -- tasks ---------------------------------------------------------------------------------------------


class PkbData(vf.TaskData):
    problem: str
    number: int
    category: str
    arguments: list[str]
    world_size: int
    backend: str
    dtype: str


class PkbState(vf.State):
    answer: str | None = None
    """The reply last judged."""
    verdict: dict[str, Any] | None = None
    """Its verdict: the JSON of ``pkb eval --json`` (``status`` no_code when the reply held no file)."""
    num_evaluations: int = 0


class PkbTask(vf.Task[PkbData, PkbState, PkbTaskConfig]):
    async def verdict(self, trace: vf.Trace) -> dict[str, Any]:
        """The verdict on the rollout's last reply: evaluated once, then read from the rollout's state."""
        state, reply = trace.state, trace.last_reply
        if state.verdict is None or state.answer != reply:
            name = f"{self.data.id}/{trace.id[:12]}/{state.num_evaluations}"
            state.verdict, state.answer = await self._evaluate(reply, name), reply
            state.num_evaluations += 1
            trace.info.setdefault("pkb_verdicts", []).append(
                {key: state.verdict.get(key) for key in ("status", "upstream_ok", "speedup", "roofline_fraction",
                                                         "message", "attempts")})
        return state.verdict

    def feedback(self, step: int, verdict: dict[str, Any]) -> str:
        """The next user message after the answer of ``step`` (from 0) was judged, as ``pkb agent`` sends it."""
        return common.next_message(self.data.arguments, step, verdict)

    async def finalize(self, trace: vf.Trace, runtime) -> None:
        await self.verdict(trace)  # before scoring; the rewards read it (offline scoring: the metric, run first)

    @vf.metric
    async def pkb(self, trace: vf.Trace) -> dict[str, float]:
        verdict = await self.verdict(trace)
        metrics = rewards(verdict, self.config.log_speedup_cap)
        metrics["num_evaluations"] = float(trace.state.num_evaluations)
        if verdict.get("speedup") is not None:  # the raw speedup, when the verdict has one
            metrics["speedup"] = float(verdict["speedup"])
        return metrics

    @vf.reward
    async def correctness(self, trace: vf.Trace) -> float:
        return rewards(await self.verdict(trace), self.config.log_speedup_cap)["correctness"]

    @vf.reward(weight=0.0)
    async def fast_1(self, trace: vf.Trace) -> float:
        return rewards(await self.verdict(trace), self.config.log_speedup_cap)["fast_1"]

    @vf.reward(weight=0.0)
    async def log_speedup(self, trace: vf.Trace) -> float:
        return rewards(await self.verdict(trace), self.config.log_speedup_cap)["log_speedup"]

    @vf.reward(weight=0.0)
    async def roofline_fraction(self, trace: vf.Trace) -> float:
        return rewards(await self.verdict(trace), self.config.log_speedup_cap)["roofline_fraction"]

    async def _evaluate(self, reply: str, name: str) -> dict[str, Any]:
        verdict = await asyncio.to_thread(common.judge, self.config.client(), self.data.problem, reply,
                                          self.config.no_verdict_retries, name=name,
                                          world_size=self.data.world_size, dtype=self.data.dtype,
                                          **self.config.eval_options())
        verdict.pop("code", None)
        return verdict


class PkbTaskset(vf.Taskset[PkbTask, PkbTasksetConfig]):
    def load(self):
        config = self.config
        if config.backend not in BACKENDS:
            raise ValueError(f"unknown backend {config.backend!r}; use one of {', '.join(BACKENDS)}")
        request_options(dtype=config.dtype, **config.task.eval_options())  # a wrong option says so before any work
        client = config.task.client()
        query = {"backend": config.backend, "world_size": config.world_size, "dtype": config.dtype}
        if config.hardware:
            query["hardware"] = config.hardware
        for summary in select_problems(client.problems(), config):
            prompt = client.prompt(summary["name"], **query)
            arguments = client.problem(summary["name"])["arguments"]
            data = PkbData(id=f"{summary['name']}-w{config.world_size}-{config.backend}-{config.dtype}",
                           name=summary["name"], prompt=prompt["user"], system_prompt=prompt["system"],
                           problem=summary["name"], number=summary["number"] or 0, category=summary["category"],
                           arguments=arguments, world_size=config.world_size, backend=config.backend,
                           dtype=config.dtype)
            yield PkbTask(data, config.task)


def select_problems(problems: list[dict], config: PkbTasksetConfig) -> list[dict]:
    """The service's problem summaries that ``config`` asks for (pkb.rl.common.choose_problems)."""
    return common.choose_problems(problems, config.problems, config.categories, config.world_size, config.dtype)


# -- the policy's seat and the conversation ----------------------------------------------------------------


class PkbHarnessConfig(vf.HarnessConfig):
    pass


class PkbHarness(vf.Harness[PkbHarnessConfig]):
    """One chat completion per segment, made in this process through the rollout's interception endpoint
    (which records it on the trace): the answer is text holding the file; nothing runs in the runtime."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # a later turn relaunches on the whole conversation (Harness.resume)
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(message) for message in prompt or []]
        try:
            async with httpx.AsyncClient(timeout=None) as http:
                response = await http.post(f"{endpoint.rstrip('/')}/chat/completions",
                                           json={"model": ctx.model, "messages": messages},
                                           headers={"Authorization": f"Bearer {secret}"})
        except httpx.HTTPError as exc:
            return vf.ProgramResult(MODEL_TRANSPORT_ERROR_EXIT_CODE, "", f"{type(exc).__name__}: {exc}")
        if response.status_code != 200:
            detail = f"the model call answered HTTP {response.status_code}: {response.text[-2000:]}"
            return vf.ProgramResult(1, "", detail)
        return vf.ProgramResult(0, "", "")


class PkbEnv(vf.Env[PkbEnvConfig]):
    """One conversation per rollout: the prompt, the model's file, and with ``max_turns > 1`` the verdict
    as the next user message until the file is correct or the turns run out."""

    async def run(self, task: PkbTask, agents) -> None:
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()
            for step in range(self.config.max_turns):
                if segment.terminated:
                    break
                verdict = await task.verdict(interaction.trace)
                if verdict["status"] == "ok" or step + 1 == self.config.max_turns:
                    break
                segment = await interaction.turn(task.feedback(step, verdict))


def load_environment(server_url: str | None = None, problems: str | int | list | None = None,
                     categories: str | list[str] | None = None, world_size: int = 2, backend: str = "cuda",
                     dtype: str = DEFAULT_PRECISION, mode: str = "cpu", max_turns: int = 1, cases: str | None = None,
                     trials: int | None = None, upstream_trials: int | None = None, perf: bool = False,
                     policy: str | None = None, timeout: float | None = None, hardware: str | None = None,
                     weights: dict[str, float] | None = None, log_speedup_cap: float = 3.0,
                     solution_set: str = "rl", no_verdict_retries: int = NO_VERDICT_RETRIES,
                     env_config: dict | None = None) -> PkbEnv:
    """The environment over ``pkb serve`` at ``server_url`` (default $PKB_SERVE_URL): prompts of ``problems``
    (slugs or numbers) and ``categories`` (None: all) that run at ``world_size`` in ``dtype``, for ``backend``;
    answers judged with the options of ``pkb eval`` (``mode`` ... ``timeout``; None: the service's default);
    ``weights`` by reward name (see the module's docstring); ``no_verdict_retries``: evaluations again of a file
    that got no verdict before it scores 0; ``env_config``: more fields of the env's config
    (e.g. ``{"agent": {"max_output_tokens": 8192}}``)."""
    unknown = set(weights or {}) - set(REWARDS)
    if unknown:
        raise ValueError(f"unknown rewards {sorted(unknown)}; the rewards are {', '.join(REWARDS)}")
    weights = {"correctness": 1.0, **{name: 1.0 if perf else 0.0 for name in REWARDS[1:]}, **(weights or {})}
    task = PkbTaskConfig(server_url=server_url, mode=mode, cases=cases,
                         trials=trials, upstream_trials=upstream_trials, perf=perf, policy=policy, timeout=timeout,
                         solution_set=solution_set, log_speedup_cap=log_speedup_cap,
                         no_verdict_retries=no_verdict_retries,
                         rewards={name: vf.RewardFunctionConfig(weight=weight) for name, weight in weights.items()})
    task.client()  # no URL: say how to start a server now, not at the first rollout
    taskset = PkbTasksetConfig(problems=common.names(problems), categories=common.names(categories), world_size=world_size,
                               backend=backend, dtype=dtype, hardware=hardware, task=task)
    return vf.load_environment(PkbEnvConfig(taskset=taskset, max_turns=max_turns, **(env_config or {})))


__all__ = ["PkbData", "PkbEnv", "PkbEnvConfig", "PkbHarness", "PkbHarnessConfig", "PkbState", "PkbTask",
           "PkbTaskConfig", "PkbTaskset", "PkbTasksetConfig", "load_environment", "rewards", "select_problems"]
