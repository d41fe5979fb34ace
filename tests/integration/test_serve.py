"""``pkb serve``, ``pkb.client`` and ``pkb eval --server`` (issue 27), in ``cpu`` mode at W = 2.

One server process for the module (started as a user starts it, on a port the system picks); the
evaluations are light (the tests cases, one trial) so the module stays fast on two cores. The app's own
failure, without a server: tests/unit/test_serve_app.py.
"""

from __future__ import annotations

import http.client
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.sources import ALLGATHER
from pkb.client import Client, ServerError

ROOT = Path(__file__).resolve().parents[2]
LIGHT = {"world_size": 2, "mode": "cpu", "cases": "tests", "trials": 1, "upstream_trials": 1}

CORRECT = ALLGATHER.format(tail="")
WRONG = ALLGATHER.format(tail=" * 2")
CRASHING = ALLGATHER.format(tail="\n\nraise_at_import = None\nsolution = lambda tensor: 1 / 0")
SLOW = ALLGATHER.format(tail="\n\nimport time\n_gather = solution\n_calls = []\n\n\ndef solution(tensor):\n"
                            "    if not _calls:  # its first call: the job runs 4 s at least\n        time.sleep(4)\n"
                            "    _calls.append(1)\n    return _gather(tensor)")


def _start(tmp: Path, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    url_file = tmp / "url"
    process = subprocess.Popen([sys.executable, "-m", "pkb", "serve", "--url-file", str(url_file), "--db",
                                str(tmp / "served.sqlite"), *args], cwd=tmp, env={**os.environ, **(env or {})},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (url_file.is_file() and url_file.read_text().strip()):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"pkb serve did not start: {process.stdout.read()}")
        time.sleep(0.2)
    return process, url_file.read_text().strip()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    process, url = _start(tmp, "--max-queue", "2")
    yield url, tmp
    process.terminate()
    process.wait(timeout=30)


def test_verdicts_through_the_client_are_stored(server):
    url, tmp = server
    client = Client(url)
    verdicts = {name: client.evaluate("allgather", source, name=name, **LIGHT, **experiment)
                for name, source, experiment in (("correct", CORRECT, {"experiment": "week2"}), ("wrong", WRONG, {}),
                                                 ("crashing", CRASHING, {}))}
    assert {n: r["status"] for n, r in verdicts.items()} == {"correct": "ok", "wrong": "mismatch",
                                                             "crashing": "runtime_error"}
    assert verdicts["wrong"]["details"]["case"] and "ZeroDivisionError" in verdicts["crashing"]["message"]
    assert all(r["solution_set"] == "served" and r["world_size"] == 2 and r["mode"] == "cpu" for r in verdicts.values())
    with sqlite3.connect(tmp / "served.sqlite") as db:
        stored = {solution: (status, experiment) for solution, status, experiment in db.execute(
            "SELECT solution, status, experiment FROM results WHERE solution_set = 'served'")}
    # service traffic is an experiment of its own (`served`), unless a request names one
    assert stored == {"correct": ("ok", "week2"), "wrong": ("mismatch", "served"),
                      "crashing": ("runtime_error", "served")}
    assert {n: r["experiment"] for n, r in verdicts.items()} == {n: e for n, (_, e) in stored.items()}


@pytest.mark.parametrize("candidate", ["file", "reference"])
def test_pkb_eval_server_gives_the_verdict_of_pkb_eval_without_torch(server, tmp_path, candidate):
    """Same verbs, same answers: a file or ``reference``, through the service and here."""
    url, _ = server
    path = tmp_path / "2_allgather.py"
    path.write_text(CORRECT)
    target = str(path) if candidate == "file" else "reference"
    options = ["--json", "--world-size", "2", "--mode", "cpu", "--cases", "upstream", "--trials", "1",
               "--upstream-trials", "1"]
    code = ("import json, sys\nfrom pkb.cli import main\n"
            f"rc = main(['eval', '2', {target!r}, '--server', {url!r}, *{options!r}])\n"
            "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    result, summary = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert summary == {"rc": 0, "torch": False}, done.stderr
    here = subprocess.run([sys.executable, "-m", "pkb", "eval", "2", target, *options], capture_output=True, text=True,
                          timeout=300)
    local = json.loads(here.stdout.strip().splitlines()[-1])
    keys = ("status", "upstream_ok", "problem", "solution", "cases", "world_size", "mode")
    assert {k: result[k] for k in keys} == {k: local[k] for k in keys}, here.stderr
    assert result["status"] == "ok" and result["upstream_ok"] is True
    assert result["solution"] == ("2_allgather" if candidate == "file" else "reference")


@pytest.mark.parametrize("name, shown", [("mine_crashes", "mine_crashes.py"), ("../../etc/x", "2_allgather.py")])
def test_a_crash_through_the_service_names_the_file_as_the_client_named_it(server, name, shown):
    """A new user's walk (issue 54): through `pkb eval --server` a crash named a copy after the problem
    (2_allgather.py), never the user's file; the service now writes the source under the request's name (`pkb eval
    --server` sends the file's stem), where it is a plain file name."""
    url, _ = server
    source = CORRECT + "\n\ndef solution(tensor):\n    return tensor / 0 + undefined_name\n"
    result = Client(url).evaluate(2, source, name=name, **LIGHT)
    assert result["status"] == "runtime_error", result["message"]
    where = (result["details"].get("traceback") or "") + result["message"]
    assert f"{shown}\", line " in where or f"{shown}:" in where, where
    assert ("mine_crashes" in where) is (shown == "mine_crashes.py"), where


def test_a_full_queue_answers_busy_and_loses_nothing(server):
    url, _ = server
    client = Client(url, busy_timeout_s=0)
    submitted = [client.submit("allgather", SLOW, name=f"slow{i}", **LIGHT) for i in range(2)]
    with pytest.raises(ServerError) as busy:
        client.submit("allgather", CORRECT, name="third", **LIGHT)
    assert busy.value.status == 429
    finished = [client.evaluation(served["id"], wait_s=300) for served in submitted]
    assert [served["result"]["status"] for served in finished] == ["ok", "ok"]
    assert client.health()["queued_or_running"] == 0


def test_bad_requests_get_a_clear_error(server):
    url, _ = server
    client = Client(url)
    for options, words in (({"problem": "no_such_problem"}, "no_such_problem"), ({"dtype": "fp64"}, "dtype"),
                           ({"colour": "red"}, "unknown fields"), ({"world_size": 3}, "world sizes"),
                           ({"reference": True}, "not both"), ({"timeout": 0}, "`timeout` must be from 1"),
                           ({"world_size": 4, "nodes": 3}, "4 ranks do not split into 3 nodes")):
        body = {"problem": "allgather", "source": CORRECT, **options}
        with pytest.raises(ServerError) as error:
            client._call("POST", "/v1/evaluations", body)
        assert error.value.status == 400 and words in str(error.value)
    # a body over 2 MiB is refused from its declared length, before it is read (sent here without the body:
    # a client still writing 3 MiB when the refusal comes would see a broken pipe instead of the answer)
    # a chunked body declares no length: refused by the running count once it passes 2 MiB (all of it written
    # before the answer is read, so the refusal cannot race the writes)
    chunk = b" " * (64 << 10)
    chunked = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * ((2 << 20) // len(chunk) + 1)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    undecodable = http.client.HTTPConnection(host, int(port), timeout=60)
    undecodable.request("POST", "/v1/evaluations", body=b'{"problem": "allgather", "source": "\xff"}',
                        headers={"Content-Type": "application/json"})
    answer = undecodable.getresponse()
    assert answer.status == 400 and "not UTF-8" in json.loads(answer.read())["error"]
    undecodable.close()
    for header, value, body in (("Content-Length", str(3 << 20), []), ("Transfer-Encoding", "chunked", chunked)):
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.putrequest("POST", "/v1/evaluations")
        connection.putheader("Content-Type", "application/json")
        connection.putheader(header, value)
        connection.endheaders()
        for piece in body:
            connection.send(piece)
        refused = connection.getresponse()
        assert refused.status == 413 and "over" in json.loads(refused.read())["error"], header
        connection.close()


def test_problems_and_prompts(server):
    url, _ = server
    client = Client(url)
    problems = client.problems()
    assert len(problems) >= 87 and problems[0]["number"] == 1
    allgather = client.problem(2)
    assert allgather["arguments"] == ["tensor"] and "all_gather" in allgather["reference"]
    kinds = {case["kind"] for case in allgather["cases"]}
    assert {"upstream", "tests"} <= kinds
    assert all(case["tags"] for case in allgather["cases"] if case["kind"] == "tests")
    prompt = client.prompt(2, dtype="fp32", world_size=4)
    assert prompt["precision"] == "fp32" and "fp32" in prompt["user"] and prompt["world_size"] == 4


def test_only_loopback_without_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PKB_SERVE_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "pkb", "serve", "--host", "0.0.0.0"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 2 and "token" in done.stderr


def test_a_token_is_required_when_set(tmp_path):
    process, url = _start(tmp_path, env={"PKB_SERVE_TOKEN": "s3cret-for-this-test"})
    try:
        with pytest.raises(ServerError) as refused:
            Client(url).health()
        assert refused.value.status == 401
        assert Client(url, token="s3cret-for-this-test").health()["ok"] is True
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_service_that_cannot_store_verdicts_or_listen_does_not_start(tmp_path, capsys):
    """A --db that is a directory or not a database, and a port another process holds: one sentence, exit 2,
    nothing started and nothing written (issue 49: it used to start, say ok on /v1/health, and keep every
    request queued for ever, or print a traceback)."""
    import socket

    from pkb.cli import main

    text = tmp_path / "notes.txt"
    text.write_text("mine\n")
    for db, said in ((tmp_path, "is a directory"), (text, "is not a pkb results database")):
        assert main(["serve", "--db", str(db), "--url-file", str(tmp_path / "url")]) == 2
        assert said in capsys.readouterr().err
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--db", str(tmp_path / "new.sqlite")]) == 2
        err = capsys.readouterr().err
        assert f"cannot listen on 127.0.0.1:{port}: another process uses that port" in err and "Traceback" not in err
    finally:
        taken.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and text.read_text() == "mine\n"
