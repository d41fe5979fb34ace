"""A user's mistake is one sentence and exit status 2, before any work and with nothing written (issue 49): every
number of every command is checked against its row of pkb.options where it is parsed; options become an
``EvalConfig`` in one function (``resolve``), which also refuses what two options break together; a
``--db`` pkb cannot store results in, a directory given as the candidate and ``--json`` with a usage error; an
unknown flag (the subcommand's closest) and an unknown problem (the closest names, read from the suite's source);
the exit status of ``skipped``; a crash's traceback with the user's file first; and what ``pkb run`` ends with. In process: ``main`` returns
before any rank process starts. The service's mistakes: tests/unit/test_serve_app.py and
tests/integration/test_serve.py."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from pkb.cli import build_parser, exit_status, main, print_run_summary, user_traceback, what_it_means
from pkb.console import UsageError
from pkb.evaluate.config import EvalConfig, OptionError, resolve
from pkb.options import BUILD_ALLOWANCE_S, OPTIONS, Status
from pkb.registry import _not_as_declared, all_problems, get_problem, problem_names, select, selected_names
from pkb.runtime.modes import Mode
from pkb.store.db import REFERENCE_SET, SHIPPED_SET, ResultStore, StoreUnavailable, check_store

PACKAGE = Path(__file__).resolve().parents[2] / "pkb"
NOT_YET_CHECKED: set[tuple[str, str]] = set()  # every number of every command is checked where it is parsed


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def numeric_flags():
    """(command, flag, argparse action) of every flag of every command that takes a number."""
    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for command, subparser in commands.items():
        for action in subparser._actions:
            if action.option_strings and getattr(action.type, "__name__", "") in ("int", "float"):
                yield command, action.option_strings[-1], action


# -- every option of every command, checked where it is parsed ------------------------------------------------


def test_every_number_every_command_takes_is_checked_against_its_row_where_it_is_parsed():
    flags = list(numeric_flags())
    assert len(flags) >= 25
    unchecked = sorted((command, flag) for command, flag, action in flags if not hasattr(action.type, "option"))
    assert set(unchecked) == NOT_YET_CHECKED, unchecked
    for command, flag, action in flags:
        option = getattr(action.type, "option", None)
        if option is None or option.low is None:
            continue
        with pytest.raises(Exception, match=re.escape(f"must be {option.bounds}, got ")):  # argparse: a usage error
            action.type(str(option.low - 1))
        assert action.type(str(option.low)) == option.low


@pytest.mark.parametrize("argv, said", [
    (["eval", "1", "reference", "--timeout", "0"], "argument --timeout: must be from 1 to 3600, got 0 ("),
    (["eval", "1", "reference", "--timeout", "-5"], "argument --timeout: must be from 1 to 3600"),
    (["eval", "1", "reference", "--world-size", "0"], "argument --world-size: must be from 1 to 1024, got 0"),
    (["eval", "1", "reference", "--trials", "0"], "argument --trials: must be from 1 to 100, got 0"),
    (["eval", "1", "reference", "--timeout", "nan"], "must be a finite number"),
    (["run", "--parallel", "0"], "argument --parallel: must be from 1 to 1024"),
    (["generate", "--model", "replay:x", "--problems", "1", "--samples", "0"], "argument --samples"),
    (["agent", "--model", "replay:x", "--problems", "1", "--steps", "0"], "argument --steps"),
    (["serve", "--max-queue", "0"], "argument --max-queue"),
    (["serve", "--port", "70000"], "argument --port: must be from 0 to 65535"),
    (["baseline", "--world-size", "0"], "argument --world-size"),
    (["show", "1", "--nodes", "0"], "argument --nodes"),
])
def test_an_option_out_of_its_range_is_one_sentence_and_exit_2(capsys, argv, said):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert said in err and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"pkb {argv[0]}: error: ") and f"`pkb {argv[0]} --help`" in err


def test_with_json_a_usage_error_is_one_object_on_stdout(capsys, tmp_path):
    for argv in (["eval", "1", "reference", "--world-size", "0", "--json"],
                 ["eval", "1", str(tmp_path), "--json"],
                 ["eval", "nosuch", "reference", "--json"],
                 ["run", "--bogus", "--json"]):
        code, out, err = run(capsys, *argv)
        answer = json.loads(out)
        assert code == 2 and answer["status"] == "usage_error" and answer["command"] == argv[0], out
        assert answer["message"] in err


def test_nodes_that_do_not_divide_the_world_size_are_a_usage_error_before_any_work(capsys):
    code, _, err = run(capsys, "eval", "1", "reference", "--world-size", "4", "--nodes", "3", "--mode", "cpu")
    assert code == 2 and "4 ranks do not split into 3 nodes of equal size" in err and "mode:" not in err


def test_a_directory_given_as_the_candidate_is_said_to_be_one(capsys, tmp_path):
    code, _, err = run(capsys, "eval", "1", str(tmp_path))
    assert code == 2 and f"{tmp_path} is a directory: give one .py file" in err and "not found" not in err


@pytest.mark.parametrize("command", [["report"], ["transcripts"], ["report", "--html", "x.html"]])
def test_a_directory_given_as_the_database_to_read_is_said_to_be_one(capsys, tmp_path, command):
    """A new user's walk (issue 54): `pkb report --db DIR` said there was no database at DIR although DIR held one;
    every command that reads results now says what `pkb run` says: it is a directory, give the file in it."""
    code, _, err = run(capsys, *command, "--db", str(tmp_path))
    assert code == 2 and f"{tmp_path} is a directory: give the results database's file, e.g. --db {tmp_path}/" in err, err


# -- unknown flags and problems (issue 54.3; that no torch is imported: tests/integration/test_cli.py) ----------


@pytest.mark.parametrize("argv, flag", [
    (["eval", "1", "x.py", "--world_size", "4"], "--world-size"),
    (["eval", "1", "x.py", "--tiemout=3"], "--timeout"),
    (["run", "--paralel", "2"], "--parallel"),
    (["generate", "--model", "replay:x", "--problems", "1", "--max_tokens", "9"], "--max-tokens"),
    (["eval", "1", "x.py", "--trial", "1"], "--trials"),  # a prefix is not taken for the flag: it is named
    (["run", "--problem", "1"], "--problems"),
])
def test_an_unknown_flag_suggests_the_closest_flag_of_its_subcommand_and_its_own_help(capsys, argv, flag):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"pkb {argv[0]}: error: unrecognized arguments: ")
    assert f"; did you mean {flag}? (`pkb {argv[0]} --help` lists what it takes)" in err


def test_a_mistyped_option_of_a_request_to_the_service_gets_the_closest_one():
    """A new user's walk (issue 54): `Client.evaluate(..., world_sise=2)` named no option, where the command line
    would have."""
    from pkb.options import request_options

    with pytest.raises(ValueError, match=r"unknown option 'world_sise'; did you mean 'world_size'\?"):
        request_options(world_sise=2)


def test_a_mistyped_subcommand_suggests_the_closest_one(capsys):
    """A new user's walk (issue 54): `pkb evl` listed the 14 subcommands without a guess."""
    code, _, err = run(capsys, "evl", "1", "x.py")
    assert code == 2 and "did you mean eval?" in err and "`pkb --help`" in err, err
    code, _, err = run(capsys, "zzzz")
    assert code == 2 and "did you mean" not in err, err


def test_an_empty_server_url_is_a_usage_error_not_a_local_evaluation(capsys):
    code, out, err = run(capsys, "eval", "1", "x.py", "--server", "")
    assert code == 2 and out == "" and "--server is empty: give the URL `pkb serve` prints" in err


def test_a_flag_like_none_of_the_subcommands_is_refused_without_a_guess(capsys):
    code, _, err = run(capsys, "eval", "1", "x.py", "--frobnicate")
    assert code == 2 and "did you mean" not in err
    assert err == "pkb eval: error: unrecognized arguments: --frobnicate (`pkb eval --help` lists what it takes)\n"


@pytest.mark.parametrize("argv", [["eval", "allreduse", "x.py"], ["show", "allreduse"], ["run", "--problems", "1-3,allreduse"],
                                  ["report", "--problems", "allreduse"], ["prompt", "allreduse"]])
def test_an_unknown_problem_is_said_with_the_closest_names_by_every_command(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("pkb: error: unknown problem 'allreduse'; did you mean 1 allreduce") and err.count("\n") == 1


def test_the_names_read_from_the_suites_source_are_the_problems_discovery_imports():
    def entries(problems) -> list[tuple]:
        return [(p.name, p.upstream_id, p.category, p.module) for p in problems]

    assert entries(problem_names().values()) == entries(all_problems().values())
    assert selected_names("1-3,hierarchical_alltoall") == [p.name for p in select("1-3,hierarchical_alltoall")]


def test_a_problem_its_source_does_not_declare_as_discovery_finds_it_is_named():
    problems = list(all_problems().values())
    recategorised = SimpleNamespace(name="allreduce", upstream_id=1, category="tensor_parallel",
                                    module="pkb.problems.collectives.allreduce")
    assert _not_as_declared(problems) == []
    assert _not_as_declared([recategorised] + problems[1:]) == ["pkb.problems.collectives.allreduce"]
    assert _not_as_declared(problems[1:]) == ["pkb.problems.collectives.allreduce"]  # imported, yet not declared


def test_skipped_exits_0_from_eval_as_from_run_and_pkbs_own_failure_3():
    statuses = (Status.OK, Status.SKIPPED, "skipped", Status.MISMATCH, "timeout", Status.HARNESS_ERROR, "infra_error")
    assert [exit_status(status) for status in statuses] == [0, 0, 0, 1, 1, 3, 3]


# -- one function builds the config ---------------------------------------------------------------------------


def _calls_in_pkb(name: str) -> list[str]:
    """The modules of pkb that call a function named ``name`` (as ``name(...)`` or ``x.name(...)``)."""
    callers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            called = getattr(node, "func", None)
            if isinstance(node, ast.Call) and getattr(called, "id", getattr(called, "attr", None)) == name:
                callers.append(str(path.relative_to(PACKAGE)))
    return sorted(set(callers))


def test_only_resolve_builds_an_eval_config_and_chooses_a_mode_in_pkb():
    """Options resolve in one place (pkb.evaluate.config.resolve): the CLI, `run`, the service, Ray, the RL modules
    (through the service) and `pkb baseline` / `calibrate` all come there; pkb.runtime.modes decides by itself only
    what ``auto`` means on a machine."""
    assert _calls_in_pkb("EvalConfig") == ["evaluate/config.py"]
    assert _calls_in_pkb("choose_mode") == ["evaluate/config.py", "runtime/modes.py"]
    assert _calls_in_pkb("check_sandbox") == ["evaluate/config.py", "evaluate/session.py", "serve/cli.py"]


def test_resolve_names_each_setting_once_and_checks_every_bound():
    config = resolve({"trials": 2, "timeout": 20, "dtype": "fp32", "nodes": None, "mode": "cpu", "world_size": 4}).config
    assert (config.trials, config.timeout, config.dtype, config.nodes) == (2, 20, "fp32", 0)
    assert config.world_size == 4 and config.mode is Mode.CPU
    assert config.build_allowance_s == BUILD_ALLOWANCE_S and config.compile_limit_s == 20 + BUILD_ALLOWANCE_S
    assert resolve({"mode": "cpu", "world_size": 2}).config == EvalConfig(world_size=2, mode=Mode.CPU)
    assert {f.name for f in dataclasses.fields(EvalConfig)} - {"build_allowance_s"} <= set(OPTIONS)  # one spelling
    for options, said in (({"timeout": 0}, "`timeout` must be from 1 to 3600"), ({"trials": 0}, "`trials`"),
                          ({"nodes": 3}, "4 ranks do not split into 3 nodes"), ({"retries": 1}, "unknown options"),
                          ({"dtype": "fp64"}, "`dtype` must be one of"), ({"mode": "tpu"}, "`mode` must be one of")):
        with pytest.raises(OptionError, match=said):
            resolve({"mode": "cpu", "world_size": 4, **options})
    with pytest.raises(OptionError, match="`world_size` must be from 1"):
        resolve({"mode": "cpu", "world_size": 0})
    problem = get_problem("allreduce")
    assert resolve({"mode": "cpu"}, problem).config.world_size == problem.world_sizes[0]  # the problem's smallest
    with pytest.raises(OptionError, match="allreduce runs at world sizes"):
        resolve({"mode": "cpu", "world_size": 3}, problem)
    with pytest.raises(OptionError, match="mode cuda needs 2 GPUs"):
        resolve({"mode": "cuda", "world_size": 2}, num_gpus=0)


def test_the_timeout_bounds_loading_and_the_build_allowance_is_stated_in_help():
    help_text = " ".join(OPTIONS["timeout"].help.split())
    assert "loading the candidate included" in help_text and f"{BUILD_ALLOWANCE_S:g} s more" in help_text
    eval_help = " ".join(next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
                         .choices["eval"].format_help().split())
    assert f"up to {BUILD_ALLOWANCE_S:g} s more (pkb's build allowance)" in eval_help


# -- the results database -------------------------------------------------------------------------------------


def test_a_db_pkb_cannot_store_results_in_is_a_usage_error_that_writes_nothing(capsys, tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    text = tmp_path / "notes.txt"
    text.write_text("my notes\n")
    other = tmp_path / "other.sqlite"
    import sqlite3
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE mine (x)")
    before = {path: path.read_bytes() for path in (text, other)}
    for db, said in ((folder, "is a directory: give the results database's file"),
                     (text, "is not a pkb results database (not SQLite)"),
                     (text / "r.sqlite", "is a file, so"),
                     (other, "is a SQLite database of something else")):
        code, _, err = run(capsys, "run", "--problems", "1", "--mode", "cpu", "--db", str(db))
        assert code == 2 and said in err and "Traceback" not in err, err
        assert "executor:" not in err  # refused before any work
    assert list(folder.iterdir()) == [] and {path: path.read_bytes() for path in (text, other)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "notes.txt", "other.sqlite"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_db_in_a_read_only_folder_is_refused(tmp_path):
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(StoreUnavailable, match="read-only"):
            check_store(tmp_path / "r.sqlite")
    finally:
        tmp_path.chmod(0o755)


def test_the_store_error_is_a_usage_error_and_a_good_database_opens(tmp_path):
    assert issubclass(StoreUnavailable, UsageError)
    with ResultStore(tmp_path / "new" / "r.sqlite") as store:
        assert store.schema_version > 0
    check_store(tmp_path / "new" / "r.sqlite")  # pkb's own: fine
    ResultStore(tmp_path / "new" / "r.sqlite").close()


# -- what a user reads ----------------------------------------------------------------------------------------


def test_a_crash_shows_the_users_file_and_line_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine.py"
    scratch = "/tmp/pkb-scratch-x/pkb-candidate/rank0/mine.py"
    traceback = (f'Traceback (most recent call last):\n  File "{PACKAGE}/runtime/worker.py", line 309, in worker_main\n'
                 f'    reply = handlers[job["op"]](job)\n  File "{PACKAGE}/runtime/guards.py", line 150, in run\n'
                 f'    return fn(*args)\n  File "{scratch}", line 5, in solution\n    return x / y\n'
                 "ZeroDivisionError: division by zero")
    shown = user_traceback(traceback, str(mine)).splitlines()
    assert shown == ["Traceback (most recent call last):", "  (2 frames of pkb's own code before it left out)",
                     '  File "mine.py", line 5, in solution', "    return x / y", "ZeroDivisionError: division by zero"]
    inside_pkb = traceback.replace(scratch, f"{PACKAGE}/runtime/other.py")
    assert user_traceback(inside_pkb, None) == inside_pkb  # never reaches the candidate: kept whole


def test_a_hung_ranks_stack_shows_the_users_frames_and_counts_pkbs(tmp_path, monkeypatch):
    """A new user's walk (issue 54): a hang's rank output was faulthandler's whole dump, the scratch copy's path and
    13 frames of pkb after the user's line; now the user's file as they named it, and a count of pkb's frames."""
    monkeypatch.chdir(tmp_path)
    scratch = "/tmp/pkb-scratch-x/pkb-candidate/rank0/hang.py"
    dump = (f'Current thread 0x00007f10186b2b80 (most recent call first):\n  File "{scratch}", line 2 in solution\n'
            f'  File "{PACKAGE}/runtime/guards.py", line 425 in run\n  File "{PACKAGE}/runtime/worker.py", line 148 in '
            'call\n  File "<string>", line 1 in <module>')
    shown = user_traceback(dump, str(tmp_path / "hang.py")).splitlines()
    assert shown == ["Current thread 0x00007f10186b2b80 (most recent call first):",
                     '  File "hang.py", line 2 in solution', "  (3 frames of pkb's own code below left out)"], shown


def test_a_syntax_errors_place_is_said_once(capsys):
    """A new user's walk (issue 54): the place of a syntax error was printed in the message and again as the first line
    of the error below it."""
    from pkb.cli import print_verdict
    from pkb.evaluate.result import Details, EvalResult

    place = "/tmp/st/mine.py:3:21: expected ':'"
    result = EvalResult(problem="allreduce", problem_version=1, solution="mine", solution_sha256="0" * 64,
                        status=Status.COMPILE_ERROR, message=f"fails pkb's rule. pkb's: syntax error: {place}",
                        world_size=2, mode="cpu", details=Details(error=f"{place}\n    def solution(tensor)\n"))
    print_verdict(result)
    out = capsys.readouterr().out
    assert out.count(place) == 1 and "    def solution(tensor)" in out, out


def results_of(*rows):
    from pkb.evaluate.result import EvalResult

    return [EvalResult(problem=problem, problem_version=1, solution=solution, solution_sha256="0" * 64, status=status,
                       mode="cpu", world_size=2, solution_set=solution_set, message=message)
            for problem, solution, solution_set, status, message in rows]


def test_run_lists_each_result_that_needs_a_look_cut_between_words_with_an_ellipsis(capsys):
    """The issue's block ended at `(expected 1.24219, g`: a message is now cut where a word or number ends, marked
    with an ellipsis, and the run says where the whole of it is; one that fits is shown whole, its lines joined."""
    from pkb.cli import MESSAGE_CHARS

    head = ("fails pkb's rule and upstream's: rank 0, case upstream, trial 0: out: 1012477 of 1048576 "
            "elements off (atol=0.0625, rtol=0.015625); largest abs error 8.598 at [337, 806]")
    long_message = head + " " + "x" * (MESSAGE_CHARS - len(head) - 22) + " (expected 1.24219, got 0.535156)"
    rows = results_of(("allreduce", "reference", REFERENCE_SET, Status.OK, "ok"),
                      ("allreduce", "local_only", "mine", Status.MISMATCH, long_message),
                      ("allgather", "short", "mine", Status.TIMEOUT, "rank 1 hung\nin step 2"),
                      ("broadcast", "fine", "mine", Status.OK, "ok"))
    print_run_summary(rows, None, "pkb-results.sqlite")
    out = capsys.readouterr().out
    shown = out.split("  allreduce / local_only (mine): mismatch\n    ")[1].splitlines()[0]
    assert shown.endswith("(expected 1.24219\u2026") and shown == long_message[:len(shown) - 1] + "\u2026"
    assert len(shown) <= MESSAGE_CHARS
    assert "  allgather / short (mine): timeout\n    rank 1 hung in step 2\n" in out
    assert "(a message ending in \u2026 is whole in `pkb report --format json --table rows`)" in out
    assert "`pkb report --problems 1-3 --html report.html` plots the 3 problems this run's sets cover" in out


def test_the_main_job_says_what_it_means_on_this_machine():
    rows = results_of(("allreduce", "reference", REFERENCE_SET, Status.OK, "ok"),
                      ("hierarchical_allreduce", "reference", REFERENCE_SET, Status.SKIPPED, "runs at [4, 8], not 2"),
                      ("allreduce", "1_allreduce_cuda_peer", SHIPPED_SET, Status.SKIPPED, "needs a GPU"),
                      ("allreduce", "1_allreduce_two_step", SHIPPED_SET, Status.OK, "ok"))
    said = what_it_means(rows, EvalConfig(world_size=2, mode=Mode.CPU))
    assert said == ("what this means: 1 of 1 references passed against themselves here (1 skipped) (cpu mode, "
                    "W = 2): the suite and the harness work; pkb shipped is 2 worked examples, not a model's answers "
                    "(1 skipped: they need a GPU or more ranks). Score a model's files with `pkb run --solutions DIR`.")
    assert "\n" not in said  # a sentence, not the three paragraphs the issue read on every run
