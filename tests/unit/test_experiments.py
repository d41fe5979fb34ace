"""Experiments (issue 54): every stored result belongs to one, a report shows one (``default`` unless named) or
compares several, never service or RL traffic unasked; an RL rollout's turns are one sample; databases from
before experiments migrate, each row named from its origin; the service, the client and the RL judge carry the
experiment. No process is started: the loop's part is tests/unit/test_loop.py, the service's and the RL
environments' end to end are tests/integration/test_serve.py and test_rl_inspect.py."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from pkb.options import (DEFAULT_EXPERIMENT, EvaluationRequest, Status, request_options, rl_experiment,
                         traffic_kind)
from pkb.report import metrics, records
from pkb.store import db as store_db
from pkb.store.db import ResultStore
from helpers.reports import SELECTION, make_result, write_db


def with_experiment(result, experiment: str):
    result.experiment = experiment
    return result


ROWS = [
    make_result("allreduce", "mine/allreduce", Status.OK, upstream_ok=True),  # unnamed: filed under `default`
    with_experiment(make_result("allgather", "mine/allgather", Status.OK, upstream_ok=True), "default"),
    with_experiment(make_result("allreduce", "sweep/allreduce", Status.MISMATCH, upstream_ok=False), "sweep"),
    with_experiment(make_result("allgather", "sweep/allgather", Status.OK, upstream_ok=True), "sweep"),
    with_experiment(make_result("allreduce", "broken", Status.RUNTIME_ERROR, solution_set="served"), "served"),
    # an RL rollout of three turns, then a rollout of one: two samples, each its last turn
    *(with_experiment(make_result("allreduce", f"allreduce/1/{turn}", status, solution_set="rl", upstream_ok=False),
                      "rl") for turn, status in enumerate((Status.MISMATCH, Status.RUNTIME_ERROR, Status.MISMATCH))),
    with_experiment(make_result("allreduce", "allreduce/2/0", Status.OK, solution_set="rl", upstream_ok=True), "rl"),
]


def report_of(path: Path, experiments: tuple[str, ...] | None = (DEFAULT_EXPERIMENT,)) -> metrics.Report:
    loaded = records.load(path, "set", records.Filter(problems=frozenset(SELECTION), experiments=experiments),
                          SELECTION)
    return metrics.build_report(loaded.records, SELECTION, "set", (1,), loaded.notes, experiments=experiments or ())


def test_a_report_shows_the_default_experiment_and_names_the_others_never_mixing_in_traffic(tmp_path):
    path = write_db(tmp_path / "r.sqlite", ROWS)
    with ResultStore(path) as store:
        assert [r.experiment for r in store.results()][:2] == ["default", "default"]  # an unnamed result is filed
    report = report_of(path)
    assert report.groups == ("mine",)  # not the sweep, not the service's broken request, not the RL turns
    assert report.overall["mine"].num_samples == 2 and report.overall["mine"].pass_at_k[1] == pytest.approx(2 / 5)
    assert report.to_json()["experiments"] == ["default"]
    (note,) = [n for n in report.notes if n.startswith("experiment default")]
    assert note == ("experiment default; also in this database: rl (4 results, RL traffic), served (1 result, service "
                    "traffic), sweep (2 results): `pkb report --experiment NAME` reports one, a comma list compares "
                    "them")


def test_several_experiments_are_compared_with_each_set_named_by_its_experiment(tmp_path):
    path = write_db(tmp_path / "r.sqlite", ROWS)
    report = report_of(path, ("default", "sweep"))
    assert set(report.groups) == {"default: mine", "sweep: sweep"}
    assert report.overall["sweep: sweep"].pass_at_k[1] == pytest.approx(1 / 5)
    assert report_of(path, ("sweep",)).groups == ("sweep",)  # one experiment: its sets by their own names


def test_an_rl_rollouts_turns_are_one_sample_whose_last_turn_counts(tmp_path):
    """Four judged turns of two rollouts are two samples of set `rl`, not four: the issue counted every turn."""
    report = report_of(write_db(tmp_path / "r.sqlite", ROWS), ("rl",))
    counted = [r for r in report.records if r.group == "rl"]
    assert sorted((r.sample, r.result.solution) for r in counted) == [("allreduce/1", "allreduce/1/2"),
                                                                      ("allreduce/2", "allreduce/2/0")]
    m = report.overall["rl"]
    assert m.num_samples == 2 and m.verdicts == {"mismatch": 1, "ok": 1}
    assert records.rollout("allgather/1/0") == "allgather/1" and records.rollout("candidate") == "candidate"


def write_schema_6_db(path: Path, rows: list[tuple[str, str]]) -> None:
    """A database as pkb wrote it at schema version 6, before experiments: (solution, solution_set) per row."""
    conn = sqlite3.connect(path)
    for migration in store_db.MIGRATIONS[:6]:
        conn.executescript(migration) if isinstance(migration, str) else migration(conn)
    for solution, solution_set in rows:
        row = {"problem": "allreduce", "problem_version": 1, "solution": solution, "solution_sha256": solution,
               "solution_set": solution_set, "status": "ok", "mode": "cpu", "world_size": 2, "num_trials": 1}
        conn.execute(
            "INSERT INTO results (run_key, problem, problem_version, solution, solution_sha256, status, message, mode, "
            "world_size, num_trials, times_are_gpu_performance, collectives_used, hardware, pkb_version, "
            "schema_version, created_at, wall_s, result_json, solution_set) "
            "VALUES ('k', 'allreduce', 1, ?, ?, 'ok', '', 'cpu', 2, 1, 0, '[]', '', '0', 6, 0, 0, ?, ?)",
            (solution, solution, json.dumps(row), solution_set))
    conn.execute("PRAGMA user_version = 6")
    conn.commit()
    conn.close()


def test_a_database_from_before_experiments_migrates_each_row_named_from_its_origin(tmp_path):
    path = tmp_path / "old.sqlite"
    write_schema_6_db(path, [("reference", "reference"), ("1_allreduce_two_step", "pkb shipped"),
                             ("candidate", "served"), ("allreduce/1/0", "rl"), ("mine/allreduce", "mine")])
    with ResultStore(path) as store:
        assert store.schema_version == store_db.SCHEMA_VERSION
        columns = store.conn.execute("SELECT solution, experiment FROM results ORDER BY id").fetchall()
        stored = [(r.solution, r.experiment) for r in store.results()]
    expected = [("reference", "default"), ("1_allreduce_two_step", "default"), ("candidate", "served"),
                ("allreduce/1/0", "rl"), ("mine/allreduce", "default")]
    assert columns == expected and stored == expected  # the column and the stored result agree
    assert [r.result.solution for r in records.load(path, "set", records.Filter(), SELECTION).records] == [
        "reference", "1_allreduce_two_step", "mine/allreduce"]  # the old service and RL rows left out by default


def test_a_request_and_the_client_carry_the_experiment_checked_where_it_is_given():
    assert EvaluationRequest.from_json({"problem": "allgather", "source": "x", "experiment": "week2"}).experiment == \
        "week2"
    assert EvaluationRequest.from_json({"problem": "allgather", "source": "x"}).experiment == ""  # the service's
    for wrong in (" ", "a,b", 3):
        with pytest.raises(ValueError, match="experiment"):
            EvaluationRequest.from_json({"problem": "allgather", "source": "x", "experiment": wrong})
    assert request_options(experiment="week2", trials=1) == {"experiment": "week2", "trials": 1}
    with pytest.raises(ValueError, match="experiment"):
        request_options(experiment="a,b")
    assert (rl_experiment(), rl_experiment("week2"), rl_experiment("rl:week2")) == ("rl", "rl:week2", "rl:week2")
    assert (traffic_kind("rl:week2"), traffic_kind("served"), traffic_kind("sweep")) == ("RL traffic",
                                                                                        "service traffic", None)


def test_the_rl_judge_stores_its_turns_as_rl_traffic():
    from pkb.rl.common import judge

    class Service:
        asked: list[dict] = []

        def evaluate(self, problem, source, **options):
            self.asked.append(options)
            return {"status": "ok", "message": "", "upstream_ok": True, "speedup": None, "roofline_fraction": None}

    answer = "```python\ndef solution(tensor):\n    return tensor\n```"
    judge(Service(), "allgather", answer, name="allgather/1/0", trials=1)
    judge(Service(), "allgather", answer, name="allgather/1/1", experiment="week2")
    assert [options["experiment"] for options in Service.asked] == ["rl", "rl:week2"]


def test_the_commands_take_an_experiment_and_refuse_a_name_pkb_cannot_file():
    from pkb.cli import build_parser
    from pkb.console import UsageError

    parser = build_parser()
    for command in (["run"], ["generate", "--model", "replay:x", "--problems", "1"],
                    ["agent", "--model", "replay:x", "--problems", "1"], ["serve"]):
        assert parser.parse_args(command + ["--experiment", "week2"]).experiment == "week2"
    assert parser.parse_args(["run"]).experiment == "default" and parser.parse_args(["serve"]).experiment == "served"
    assert parser.parse_args(["report", "--experiment", "a,b", "--experiment", "c"]).experiment == ["a,b", "c"]
    with pytest.raises(UsageError, match="no comma"):
        parser.parse_args(["run", "--experiment", "a,b"])
    from pkb.report.cli import parse_experiments

    assert parse_experiments(["a,b", "c", "a"]) == ("a", "b", "c") and parse_experiments(None) == ("default",)


def test_a_folder_named_reference_is_a_set_of_candidates_not_the_self_check(tmp_path):
    """Upstream's own folder is `reference/`: its files are judged as every candidate is (all cases, the run's trials),
    and its set is not the references' self-check."""
    from pkb.evaluate.config import EvalConfig
    from pkb.registry import get_problem
    from pkb.runtime.modes import Mode
    from pkb.solution_files import light_self_checks, plan, set_name
    from pkb.store.db import REFERENCE_SET

    folder = tmp_path / "reference"
    folder.mkdir()
    (folder / "1_allreduce.py").write_text("def solution(tensor):\n    return tensor\n")
    assert set_name(folder) == "reference-files" and set_name(tmp_path) == tmp_path.name
    evaluations = plan([get_problem("allreduce")], folder, include_reference=True)
    config = EvalConfig(world_size=2, mode=Mode.CPU, trials=3)
    own, file = light_self_checks(evaluations, config, trials=1)
    assert own.solution_set == REFERENCE_SET and own.config.trials == 1 and own.config.cases == "upstream"
    assert file.solution_set == "reference-files" and file.config is None
