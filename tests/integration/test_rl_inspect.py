"""The Inspect AI task on ``pkb serve`` (pkb.rl.inspect_task, issues 27 and 54), with Inspect's scripted mock model
and through Inspect's own command line.

One server for the module, started as a user starts it (tests/integration/test_serve.py), judging in
``cpu`` mode at W = 2 with light options (the tests cases, one trial); the model is ``mockllm/model``
answering from a script, or for ``inspect eval`` tests/integration/test_generate.py's FakeModelServer, a local
OpenAI-compatible stand-in, so the runs need no GPU and no network. Inspect's logs go to the test's tmp_path,
its traces to a tmp folder of the module. The rewards a verdict gives: tests/unit/test_rl_rewards.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("inspect_ai", reason="inspect-ai is not installed (pip install -e '.[rl]')")
from inspect_ai import eval as inspect_eval  # noqa: E402
from inspect_ai.log import list_eval_logs, read_eval_log  # noqa: E402
from inspect_ai.model import ModelOutput, ModelUsage  # noqa: E402

from pkb.rl.common import REWARDS  # noqa: E402
from pkb.rl.inspect_task import pkb_kernels  # noqa: E402
from test_generate import FakeModelServer, Reply  # noqa: E402
from test_serve import CORRECT as ALLGATHER_CORRECT, _start  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning")  # Inspect's
LIGHT = {"world_size": 2, "mode": "cpu", "cases": "tests", "trials": 1, "upstream_trials": 1}
ALLREDUCE_WRONG = """
import torch.distributed as dist


def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    return out * 2
"""
REDUCESCATTER_CRASHING = """
def solution(tensor):
    return 1 / 0
"""
BROADCAST_NEEDS_A_GPU = """
REQUIRES = ("cuda",)


def solution(tensor, src=0):
    return tensor
"""
ANSWERS = {"allgather": (ALLGATHER_CORRECT, "ok"), "allreduce": (ALLREDUCE_WRONG, "mismatch"),
           "reducescatter": (REDUCESCATTER_CRASHING, "runtime_error")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server's URL and its results database."""
    tmp = tmp_path_factory.mktemp("serve")
    process, url = _start(tmp)
    yield url, tmp / "served.sqlite"
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module", autouse=True)
def inspect_data_dir(tmp_path_factory):
    """Inspect's own files (traces, sample buffers) in a tmp folder, not the user's data folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("inspect-data")))
        yield


def scripted(answer_for):
    """A mock model's ``custom_outputs``: answers ``answer_for(problem, turn)`` in a fenced block (no code
    when it is None; the
    problem read from the prompt's ``# Task:`` line, the turn from the assistant messages so far) and
    keeps every conversation it was sent. Each output says its token usage, so the mock model does not
    count tokens with tiktoken, which would download its encoding: the run stays offline."""
    sent = []

    def answer(messages, tools, tool_choice, config):
        sent.append(messages)
        problem = re.search(r"^# Task: (\w+)", messages[1].text, re.MULTILINE).group(1)
        source = answer_for(problem, sum(message.role == "assistant" for message in messages))
        text = f"Here it is:\n\n```python\n{source}```\n" if source else "I would rather not write this one."
        output = ModelOutput.from_content("mockllm/model", text)
        output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)  # else tiktoken counts (a download)
        return output

    answer.sent = sent
    return answer


def run(task, model, tmp_path):
    [log] = inspect_eval(task, model="mockllm/model", model_args={"custom_outputs": model}, log_dir=str(tmp_path),
                         display="none", ctl_server=False)
    assert log.status == "success", log.error
    return log, {sample.id: sample.scores["pkb_verdict"] for sample in log.samples}


def test_rewards_follow_the_verdict_of_each_file(server, tmp_path):
    url, _ = server
    pkb_eval = start_pkb_eval(tmp_path)  # beside the Inspect run: the same files judged without the server
    model = scripted(lambda problem, turn: ANSWERS[problem][0])
    log, scores = run(pkb_kernels(url, problems="allgather,allreduce,2,7", **LIGHT), model, tmp_path)
    assert {name: score.value["correctness"] for name, score in scores.items()} == {
        "allgather": 1.0, "allreduce": 0.0, "reducescatter": 0.0}
    verdicts = {name: score.metadata["verdict"] for name, score in scores.items()}
    assert {name: verdict["status"] for name, verdict in verdicts.items()} == {n: a[1] for n, a in ANSWERS.items()}
    assert "ZeroDivisionError" in verdicts["reducescatter"]["message"]
    assert all(v["world_size"] == 2 and v["mode"] == "cpu" and v["problem"] == name for name, v in verdicts.items())
    assert scores["allgather"].answer == ALLGATHER_CORRECT.rstrip() + "\n"
    assert all(math.isnan(score.value["upstream_ok"]) for score in scores.values())  # cases="tests": not checked
    metrics = {score.name: score.metrics["mean"].value for score in log.results.scores}
    assert metrics == pytest.approx({"correctness": 1 / 3, "upstream_ok": math.nan, "fast_1": 0.0, "log_speedup": 0.0,
                                     "roofline_fraction": 0.0}, nan_ok=True)  # NaN: no sample scored, not a 0.0
    assert {score.name: score.unscored_samples for score in log.results.scores}["upstream_ok"] == 3
    assert len(model.sent) == 3  # one turn each
    pkb_eval.wait(timeout=300)
    printed = (tmp_path / "pkb-eval.out").read_text().splitlines()
    results = [json.loads(line) for line in printed if line.startswith("{")]
    assert {r["problem"]: r["status"] for r in results} == {n: v["status"] for n, v in verdicts.items()}, \
        (tmp_path / "pkb-eval.err").read_text()


def start_pkb_eval(tmp_path) -> subprocess.Popen:
    """``pkb eval --json`` on each file of ANSWERS, here, without the server (one process for the three);
    its output in ``pkb-eval.out`` and ``.err``."""
    runs = []
    for problem, (source, _) in ANSWERS.items():
        path = tmp_path / f"{problem}.py"
        path.write_text(source)
        runs.append(["eval", problem, str(path), "--json", "--world-size", "2", "--mode", "cpu", "--cases", "tests",
                     "--trials", "1", "--upstream-trials", "1"])
    code = f"from pkb.cli import main\nfor args in {runs!r}:\n    main(args)\n"
    with open(tmp_path / "pkb-eval.out", "w") as stdout, open(tmp_path / "pkb-eval.err", "w") as stderr:
        return subprocess.Popen([sys.executable, "-c", code], stdout=stdout, stderr=stderr)


def test_the_verdict_goes_back_until_the_file_is_ok(server, tmp_path, monkeypatch):
    url, db_path = server
    monkeypatch.setenv("PKB_SERVE_URL", url)
    model = scripted(lambda problem, turn: ALLGATHER_CORRECT.replace("return out", "return out + 1") if turn == 0
                     else ALLGATHER_CORRECT)
    _, scores = run(pkb_kernels(problems=[2], max_turns=3, solution_set="multi-turn", **LIGHT), model, tmp_path)
    score = scores["allgather"]
    assert score.value["correctness"] == 1.0 and score.metadata["statuses"] == ["mismatch", "ok"]
    first, second = model.sent
    assert len(second) == len(first) + 2 and second[-1].role == "user"
    assert "(step 0) was evaluated: **mismatch**" in second[-1].text and "solution(tensor)" in second[-1].text
    with sqlite3.connect(db_path) as db:
        stored = db.execute("SELECT solution, status, experiment FROM results WHERE solution_set = 'multi-turn'"
                            ).fetchall()
    assert sorted(stored) == [("allgather/1/0", "mismatch", "rl"), ("allgather/1/1", "ok", "rl")]
    # RL traffic: in no report unless asked for, and its rollout of two turns one sample, its last turn counting
    from pkb.report import records

    assert not [r for r in records.load(db_path).records if r.group == "multi-turn"]
    [rollout] = [r for r in records.load(db_path, row_filter=records.Filter(experiments=("rl",))).records
                 if r.group == "multi-turn"]
    assert (rollout.sample, rollout.result.solution, rollout.status.value) == ("allgather/1", "allgather/1/1", "ok")


def test_an_answer_without_code_is_told_so_and_scores_zero(server, tmp_path):
    model = scripted(lambda problem, turn: None)
    _, scores = run(pkb_kernels(server[0], problems="allgather", max_turns=2, **LIGHT), model, tmp_path)
    score = scores["allgather"]
    assert score.value == dict.fromkeys(REWARDS, 0.0) and score.metadata["statuses"] == ["no_code", "no_code"]
    assert score.metadata["verdict"] is None and len(model.sent) == 2  # max_turns ends it
    assert "had no ```python code block" in model.sent[1][-1].text


def test_samples_are_the_prompts_of_the_chosen_problems(server):
    url, _ = server
    task = pkb_kernels(url, categories="collectives", world_size=4, dtype="fp32", backend="triton")
    samples = list(task.dataset)
    assert [s.id for s in samples] == ["allreduce", "allgather", "broadcast", "reduce", "scatter", "gather",
                                       "reducescatter", "alltoall"]
    assert samples[0].metadata == {"problem": "allreduce", "number": 1, "category": "collectives", "world_size": 4,
                                   "backend": "triton", "dtype": "fp32", "case": samples[0].metadata["case"]}
    system, user = samples[0].input
    assert system.role == "system" and "Triton" in user.text and "fp32" in user.text and "4 ranks" in user.text
    for asked, words in (({"problems": "allgather,no_such"}, "no_such"), ({"categories": "cooking"}, "collectives"),
                         ({"problems": "allgather", "world_size": 3}, "world size 3")):
        with pytest.raises(ValueError, match=words):
            pkb_kernels(url, **asked)


def test_a_file_that_declares_what_the_run_lacks_scores_as_failing(server, tmp_path):
    """``skipped`` (a GPU file in cpu mode) is a status the candidate chose: 0 in every reward, the paper's verdict
    included, as a failure is, never an unscored sample."""
    model = scripted(lambda problem, turn: BROADCAST_NEEDS_A_GPU)
    _, scores = run(pkb_kernels(server[0], problems="broadcast", **LIGHT), model, tmp_path)
    score = scores["broadcast"]
    assert score.metadata["statuses"] == ["skipped"] and score.value == dict.fromkeys(REWARDS, 0.0)
    assert "REQUIRES" in score.explanation


def inspect_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Inspect's own command, ``inspect ARGS``, in a new process with ``env``. The console script, as a user runs
    it: ``python -m inspect_ai`` from the checkout's root would see the build's ``pkb.egg-info`` there before the
    installed pkb, take pkb for no package and find no ``pkb/pkb_kernels``."""
    return subprocess.run([str(Path(sys.executable).with_name("inspect")), *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_inspect_eval_runs_offline_against_a_local_model_server(server, tmp_path):
    """``inspect eval pkb/pkb_kernels`` (the entry point's name) with Inspect's OpenAI-compatible provider on a local
    stand-in server: no network, no token count that downloads an encoding, exit 0, pkb's verdict in the log. A
    run whose model cannot be reached is an error: ``inspect eval-set`` exits 1 (``inspect eval`` exits 0 whatever
    its log says, Inspect's own choice); a task pkb cannot build (no service named) exits 1 from either."""
    url, _ = server
    user_env = {name: value for name, value in os.environ.items() if name != "PKB_SERVE_URL"}
    arguments = ["pkb/pkb_kernels", "--model", "openai-api/local/policy", "--display", "plain",
                 "-T", "problems=allgather", "-T", "cases=tests", "-T", "trials=1", "-T", "upstream_trials=1"]
    with FakeModelServer({"policy": [Reply(f"Here it is:\n\n```python\n{ALLGATHER_CORRECT}```\n")]}) as fake:
        env = {**user_env, "PKB_SERVE_URL": url, "LOCAL_BASE_URL": f"{fake.url}/v1", "LOCAL_API_KEY": "stand-in"}
        done = inspect_cli("eval", *arguments, "--log-dir", str(tmp_path / "ok"), env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        [request] = fake.requests_for("policy")
    assert [m["role"] for m in request["messages"]] == ["system", "user"]
    assert "# Task: allgather" in request["messages"][1]["content"]
    [log] = [read_eval_log(info) for info in list_eval_logs(str(tmp_path / "ok"))]
    assert log.status == "success", log.error
    score = log.samples[0].scores["pkb_verdict"]
    assert score.value["correctness"] == 1.0 and math.isnan(score.value["upstream_ok"])
    assert score.metadata["verdict"]["status"] == "ok" and score.metadata["verdict"]["world_size"] == 2

    failed = inspect_cli("eval-set", *arguments, "--log-dir", str(tmp_path / "unreachable"), "--max-retries", "0",
                         "--retry-attempts", "0", env={**env, "LOCAL_BASE_URL": f"http://127.0.0.1:{closed_port()}/v1"})
    assert failed.returncode == 1, failed.stdout + failed.stderr
    [log] = [read_eval_log(info, header_only=True) for info in list_eval_logs(str(tmp_path / "unreachable"))]
    assert log.status == "error" and "Connection" in log.error.message
    no_service = inspect_cli("eval", *arguments, "--log-dir", str(tmp_path / "none"), env={**env, "PKB_SERVE_URL": ""})
    assert no_service.returncode == 1 and "no pkb serve to judge answers" in no_service.stdout + no_service.stderr


def closed_port() -> int:
    """A port of 127.0.0.1 that nothing listens on (just bound and let go)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
