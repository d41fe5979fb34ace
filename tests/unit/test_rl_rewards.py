"""The rewards a verdict gives the RL environments (pkb.rl.common, issues 27, 54 and 56): correctness, the paper's
verdict, fast_1, a capped log speedup and the roofline fraction, for timed and untimed verdicts and none; no status
a candidate can cause scores more than failing; only what pkb or its executor saw fail is evaluated again, a
bounded number of times. The service is a scripted stand-in: no process starts."""

from __future__ import annotations

import pytest

from pkb.rl.common import NO_VERDICT_RETRIES, REWARDS, judge, rewards

FILE = "```python\ndef solution(tensor):\n    return tensor\n```"
# Every status a candidate's file can end in, skipped included (e.g. REQUIRES = ("cuda",) in cpu mode).
CANDIDATE_STATUSES = ("mismatch", "compile_error", "import_error", "signature_error", "runtime_error", "timeout",
                      "crash", "tampered", "forbidden", "skipped")


class ScriptedService:
    """``pkb.client.Client.evaluate`` answering the verdicts of ``statuses`` in turn (the last repeats), of a run
    with upstream cases: ``upstream_ok`` None where the evaluator leaves it so (skipped, pkb's failures)."""

    def __init__(self, *statuses: str):
        self.statuses = list(statuses)
        self.names: list[str] = []

    def evaluate(self, problem, source, **options):
        self.names.append(options["name"])
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        upstream_ok = None if status in ("skipped", "harness_error", "infra_error") else status == "ok"
        return {"status": status, "message": f"{status} #{len(self.names)}", "upstream_ok": upstream_ok,
                "speedup": None, "roofline_fraction": None, "problem": problem}


def test_rewards_of_timed_and_untimed_verdicts():
    timed = {"status": "ok", "upstream_ok": True, "speedup": 16.0, "roofline_fraction": 1.3,
             "times_are_gpu_performance": True}
    assert rewards(timed, log_speedup_cap=3.0) == {"correctness": 1.0, "upstream_ok": 1.0, "fast_1": 1.0,
                                                   "log_speedup": 1.0, "roofline_fraction": 1.0}
    off_gpu = {**timed, "times_are_gpu_performance": False}  # timed in cpu or shared-gpu mode: no speed to reward
    assert rewards(off_gpu) == {"correctness": 1.0, "upstream_ok": 1.0, "fast_1": 0.0, "log_speedup": 0.0,
                                "roofline_fraction": 0.0}
    slower = {**timed, "speedup": 0.5, "roofline_fraction": 0.25}
    assert rewards(slower) == {"correctness": 1.0, "upstream_ok": 1.0, "fast_1": 0.0, "log_speedup": 0.0,
                               "roofline_fraction": 0.25}
    wrong_but_paper_ok = {**timed, "status": "mismatch"}  # fails a stricter pkb case, passes upstream's
    assert rewards(wrong_but_paper_ok) == {**dict.fromkeys(REWARDS, 0.0), "upstream_ok": 1.0}
    assert rewards(None) == dict.fromkeys(REWARDS, 0.0)


def test_the_paper_verdict_is_left_out_where_it_was_not_checked():
    """``cases="tests"`` (or a problem without upstream cases): upstream_ok None on a judged file is no 0.0 that
    would average in as a failure; where pkb judged no file, by the answer's doing or after the retries, it is 0."""
    for status in ("ok", "mismatch", "runtime_error"):
        assert "upstream_ok" not in rewards({"status": status, "upstream_ok": None}), status
    assert rewards({"status": "mismatch", "upstream_ok": False})["upstream_ok"] == 0.0
    for status in ("skipped", "harness_error", "infra_error", "no_code"):
        assert rewards({"status": status, "upstream_ok": None})["upstream_ok"] == 0.0, status


@pytest.mark.parametrize("status", CANDIDATE_STATUSES)
def test_a_status_a_candidate_causes_scores_as_failing_and_is_not_retried(status):
    service = ScriptedService(status, "ok")
    verdict = judge(service, "allreduce", FILE, name="allreduce/0/0")
    assert verdict["status"] == status and service.names == ["allreduce/0/0"] and verdict["attempts"] == 1
    assert rewards(verdict) == dict.fromkeys(REWARDS, 0.0) == rewards({"status": "mismatch", "upstream_ok": False})


def test_no_verdict_is_retried_then_the_verdict_counts():
    service = ScriptedService("infra_error", "harness_error", "ok")
    verdict = judge(service, "allreduce", FILE, name="allreduce/0/0")
    assert verdict["status"] == "ok" and verdict["attempts"] == 3 and rewards(verdict)["correctness"] == 1.0
    assert service.names == ["allreduce/0/0", "allreduce/0/0/retry1", "allreduce/0/0/retry2"]


@pytest.mark.parametrize("status", ["harness_error", "infra_error"])
def test_no_verdict_after_the_retries_scores_zero_and_says_why(status):
    """A candidate may be what makes pkb fail: an endless retry would be an escape from every penalty."""
    service = ScriptedService(status)
    verdict = judge(service, "allreduce", FILE, name="x")
    assert len(service.names) == verdict["attempts"] == 1 + NO_VERDICT_RETRIES
    assert verdict["status"] == status and rewards(verdict) == dict.fromkeys(REWARDS, 0.0)
    assert verdict["message"].startswith(f"no verdict on the file after {1 + NO_VERDICT_RETRIES} evaluations")
    assert verdict["message"].endswith(f"{status} #{1 + NO_VERDICT_RETRIES}")  # the last one's own words
    service = ScriptedService(status)
    assert judge(service, "allreduce", FILE, no_verdict_retries=0, name="x")["attempts"] == 1 and service.names == ["x"]


def test_an_answer_without_a_file_asks_nothing():
    service = ScriptedService("ok")
    verdict = judge(service, "allreduce", "I would rather not.", name="x")
    assert verdict["status"] == "no_code" and service.names == [] and rewards(verdict) == dict.fromkeys(REWARDS, 0.0)


def test_an_unknown_problem_name_in_an_rl_task_gets_the_closest_names():
    """A new user's walk (issue 54): `-T problems=allgathr` listed all 95 names with no guess."""
    from pkb.rl.common import choose_problems

    summaries = [{"name": name, "number": number, "category": "collectives", "world_sizes": [2, 4],
                  "precisions": ["bf16"]} for number, name in ((1, "allreduce"), (2, "allgather"), (3, "broadcast"))]
    with pytest.raises(ValueError, match=r"unknown problems \['allgathr'\]; did you mean allgather\?"):
        choose_problems(summaries, ["allgathr"], None, 2, "bf16")
    assert [s["name"] for s in choose_problems(summaries, ["2", "allreduce"], None, 2, "bf16")] == ["allgather",
                                                                                                     "allreduce"]
