"""The verifiers environment on ``pkb serve`` (pkb.rl.verifiers_env, issue 27), with a scripted fake model.

One server for the module, started as a user starts it (tests/integration/test_serve.py), judging in
``cpu`` mode at W = 2 with light options (the tests cases, one trial); the model is
tests/integration/test_generate.py's FakeModelServer, an OpenAI-compatible server on 127.0.0.1 that answers
from a script per model name, so the rollouts need no GPU and no network. The weights of the rewards:
tests/unit/test_rl_verifiers_weights.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers 0.4 is not installed (pip install -e '.[rl]')")
import verifiers.v1 as vf  # noqa: E402

from pkb.cli import main  # noqa: E402
from pkb.rl.verifiers_env import REWARDS, load_environment  # noqa: E402
from test_generate import FakeModelServer, Reply  # noqa: E402
from test_serve import CORRECT as ALLGATHER_CORRECT, WRONG as ALLGATHER_WRONG, _start  # noqa: E402

LIGHT = {"mode": "cpu", "cases": "tests", "trials": 1, "upstream_trials": 1}
BROADCAST_CRASHING = """
def solution(tensor, src=0):
    return 1 / 0
"""
REDUCE_WRONG = """
def solution(tensor, dst=0):
    return tensor.clone()  # forgot to reduce
"""
# problem: (its number, the file the model answers with, the verdict pkb gives it)
ANSWERS = {"allgather": (2, ALLGATHER_CORRECT, "ok"), "broadcast": (3, BROADCAST_CRASHING, "runtime_error"),
           "reduce": (4, REDUCE_WRONG, "mismatch")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process, url = _start(tmp_path_factory.mktemp("serve"))
    yield url
    process.terminate()
    process.wait(timeout=30)


def answer(source: str) -> Reply:
    return Reply(f"Here is the file:\n\n```python\n{source.strip()}\n```\n")


def rollouts(env, tasks, model_of, fake) -> list:
    """One episode per task, all at once, each against the fake model named ``model_of(task)``."""
    async def run_all():
        async with env.serving():
            return await asyncio.gather(*(env.run_episode(task, context(model_of(task), fake)) for task in tasks))

    episodes = asyncio.run(run_all())
    assert all(episode.ok for episode in episodes), [episode.errors for episode in episodes]
    return [trace for episode in episodes for trace in episode.traces]


def context(model: str, fake: FakeModelServer) -> vf.ModelContext:
    client = vf.EvalClientConfig(base_url=f"{fake.url}/v1", api_key_var="PKB_FAKE_KEY")
    return vf.ModelContext(model=model, client=client)


def test_rewards_follow_the_verdicts_of_pkb_eval(server, tmp_path, capsys):
    env = load_environment(server, problems=list(ANSWERS), world_size=2, **LIGHT)
    tasks = list(env.taskset)
    assert [task.data.problem for task in tasks] == ["allgather", "broadcast", "reduce"]
    assert all("# Task:" in task.data.prompt and task.data.system_prompt for task in tasks)
    with FakeModelServer({name: [answer(source)] for name, (_, source, _) in ANSWERS.items()}) as fake:
        traces = rollouts(env, tasks, lambda task: task.data.problem, fake)
    by_problem = {trace.task.data.problem: trace for trace in traces}
    assert {name: trace.reward for name, trace in by_problem.items()} == {"allgather": 1.0, "broadcast": 0.0,
                                                                          "reduce": 0.0}
    for name, trace in by_problem.items():
        assert set(trace.rewards) == set(REWARDS)  # each reward is there, the timed ones weighted 0 without perf
        assert trace.metrics["correctness"] == trace.rewards["correctness"].score
        assert "upstream_ok" not in trace.metrics  # cases="tests": the paper's verdict not checked, not a 0.0
        assert trace.state.num_evaluations == 1 and trace.state.verdict["status"] == ANSWERS[name][2]

    for name, (number, source, _) in ANSWERS.items():  # the same file through `pkb eval --json`
        path = tmp_path / f"{number}_{name}.py"
        path.write_text(source)
        capsys.readouterr()
        main(["eval", str(number), str(path), "--json", "--world-size", "2", "--mode", "cpu", "--cases", "tests",
              "--trials", "1", "--upstream-trials", "1"])
        cli = json.loads(capsys.readouterr().out)
        served = by_problem[name].state.verdict
        assert (served["status"], served["upstream_ok"]) == (cli["status"], cli["upstream_ok"]), name


def test_multi_turn_sends_the_verdict_until_the_file_is_correct(server):
    env = load_environment(server, problems="allgather", world_size=2, max_turns=3, **LIGHT)
    [task] = list(env.taskset)
    with FakeModelServer({"policy": [answer(ALLGATHER_WRONG), answer(ALLGATHER_CORRECT)]}) as fake:
        [trace] = rollouts(env, [task], lambda task: "policy", fake)
        sent = [body["messages"] for body in fake.requests_for("policy")]
    assert trace.reward == 1.0 and trace.num_turns == 2 and len(sent) == 2  # stopped once correct, not at 3
    assert [v["status"] for v in trace.info["pkb_verdicts"]] == ["mismatch", "ok"]
    first_verdict = trace.info["pkb_verdicts"][0]["message"]
    assert [m["role"] for m in sent[1]] == ["system", "user", "assistant", "user"]
    assert sent[1][2]["content"].strip() == answer(ALLGATHER_WRONG).text.strip()
    assert "was evaluated: **mismatch**" in sent[1][-1]["content"] and first_verdict in sent[1][-1]["content"]
    assert sent[1][-1]["content"].rstrip().endswith("defining `solution(tensor)`.")  # pkb agent's message
