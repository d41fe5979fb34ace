"""The Inspect AI task on ``pkb serve`` (pkb.rl.inspect_task, issue 27), with Inspect's scripted mock model.

One server for the module, started as a user starts it (tests/integration/test_serve.py), judging in
``cpu`` mode at W = 2 with light options (the tests cases, one trial); the model is ``mockllm/model``
answering from a script, so the run needs no GPU and no network. Inspect's logs go to the test's tmp_path,
its traces to a tmp folder of the module. The rewards a verdict gives: tests/unit/test_rl_rewards.py.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys

import pytest

pytest.importorskip("inspect_ai", reason="inspect-ai is not installed (pip install -e '.[rl]')")
from inspect_ai import eval as inspect_eval  # noqa: E402
from inspect_ai.model import ModelOutput, ModelUsage  # noqa: E402

from pkb.rl.common import REWARDS  # noqa: E402
from pkb.rl.inspect_task import pkb_kernels  # noqa: E402
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
    metrics = {score.name: score.metrics["mean"].value for score in log.results.scores}
    assert metrics == pytest.approx({"correctness": 1 / 3, "upstream_ok": 0.0, "fast_1": 0.0, "log_speedup": 0.0,
                                     "roofline_fraction": 0.0})
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
        stored = db.execute("SELECT solution, status FROM results WHERE solution_set = 'multi-turn'").fetchall()
    assert sorted(stored) == [("allgather/1/0", "mismatch"), ("allgather/1/1", "ok")]


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
