"""Generation (pkb generate / agent) against real HTTP servers on 127.0.0.1 that speak the OpenAI
chat-completions and Anthropic messages protocols, through the real `openai` and `anthropic` SDK clients.
Evaluations run in cpu mode at world size 2 with one trial. What needs no model server (extraction, pkb prompt,
keys): tests/unit/test_generate_offline.py."""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("anthropic")

from pkb.cli import main  # noqa: E402
from pkb.generate.providers import ProviderError, ProviderSettings, connect  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GOOD_CODE = (REPO / "pkb/solutions/1_allreduce_two_step.py").read_text()
GOOD = f"Reduce-scatter then all-gather:\n\n```python\n{GOOD_CODE}```\nThat is all."
WRONG = "```python\nimport torch\n\ndef solution(tensor):\n    return tensor.clone()  # forgot the other ranks\n```"
NO_CODE = "I would need to know more about the interconnect before writing this."
BROKEN = "```python\ndef solution(tensor):\n    return tensor.clone(\n```"
EVAL = ["--mode", "cpu", "--world-size", "2", "--trials", "1"]


# -- a fake model server ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    text: str = ""
    status: int = 200
    delay_s: float = 0.0  # hang this long before answering (the client may give up first)
    headers: tuple = ()


class FakeModelServer:
    """Answers POST /v1/chat/completions and /v1/messages from a script per model name (the last reply
    repeats) and records every request."""

    def __init__(self, scripts: dict[str, list[Reply]]):
        self.scripts = {model: list(replies) for model, replies in scripts.items()}
        self.requests: list[tuple[str, dict, dict]] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def requests_for(self, model: str) -> list[dict]:
        return [body for _, body, _ in self.requests if body.get("model") == model]

    def _next(self, model: str) -> Reply:
        with self.lock:
            script = self.scripts[model]
            return script.pop(0) if len(script) > 1 else script[0]

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with server.lock:
                    server.requests.append((self.path, body, {k.lower(): v for k, v in self.headers.items()}))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    reply = server._next(body["model"])
                    if reply.delay_s:
                        server.release.wait(reply.delay_s)
                    self._answer(reply, body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left
                finally:
                    with server.lock:
                        server.in_flight -= 1

            def _answer(self, reply: Reply, body: dict):
                anthropic = self.path.endswith("/messages")
                if reply.status != 200:
                    payload = {"type": "error", "error": {"type": "rate_limit_error", "message": reply.text}}
                elif anthropic:
                    payload = {"id": "msg_1", "type": "message", "role": "assistant", "model": body["model"],
                               "content": [{"type": "text", "text": reply.text}], "stop_reason": "end_turn",
                               "stop_sequence": None, "usage": {"input_tokens": 1000, "output_tokens": 200}}
                else:
                    payload = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                               "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", "content": reply.text}}],
                               "usage": {"prompt_tokens": 1000, "completion_tokens": 200, "total_tokens": 1200}}
                data = json.dumps(payload).encode()
                self.send_response(reply.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for name, value in reply.headers:
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        return Handler

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def keys(monkeypatch):
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def generations(db: Path) -> list[dict]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    return [dict(r) for r in conn.execute("SELECT * FROM generations ORDER BY id")]


# -- providers, through the real SDKs ------------------------------------------------------------------------


def test_openai_and_anthropic_calls_report_text_tokens_cost_and_send_the_prompt(keys):
    with FakeModelServer({"gpt-4o": [Reply(GOOD)], "claude-sonnet-4-5": [Reply(WRONG)]}) as server:
        openai = connect("openai:gpt-4o", ProviderSettings(base_url=server.url + "/v1"))
        answer = openai.complete("be brief", [_user("write it")], max_tokens=64, temperature=0.5)
        assert answer.text == GOOD and (answer.tokens_in, answer.tokens_out, answer.attempts) == (1000, 200, 1)
        assert answer.cost_usd == pytest.approx((1000 * 2.5 + 200 * 10.0) / 1e6)
        _, body, headers = server.requests[-1]
        assert body["messages"][0] == {"role": "system", "content": "be brief"}
        assert body["max_completion_tokens"] == 64 and body["temperature"] == 0.5
        assert headers["authorization"] == "Bearer sk-test"

        anthropic = connect("anthropic:claude-sonnet-4-5", ProviderSettings(base_url=server.url))
        answer = anthropic.complete("be brief", [_user("write it")], max_tokens=64, temperature=0.2)
        assert answer.text == WRONG and answer.cost_usd == pytest.approx((1000 * 3 + 200 * 15) / 1e6)
        path, body, headers = server.requests[-1]
        assert path == "/v1/messages" and body["system"] == "be brief" and body["temperature"] == 0.2
        assert "sk-ant-test" in headers.get("x-api-key", "") + headers.get("authorization", "")  # by SDK release
    local = connect("vllm:my-model", ProviderSettings(base_url=server.url + "/v1"))
    assert local.settings.price_per_mtok is None  # an unknown model's cost is None, not a guess


def test_rate_limits_are_retried_and_a_hang_ends_at_the_timeout(keys):
    scripts = {"busy": [Reply("slow down", status=429, headers=(("retry-after", "0"),)), Reply(GOOD)],
               "stuck": [Reply(GOOD, delay_s=30)], "bad-key": [Reply("invalid key", status=401)]}
    with FakeModelServer(scripts) as server:
        settings = ProviderSettings(base_url=server.url + "/v1", timeout_s=0.5, max_retries=1, backoff_s=0.01)
        answer = connect("openai:busy", settings).complete("s", [_user("u")], max_tokens=16)
        assert answer.text == GOOD and answer.attempts == 2 and len(server.requests_for("busy")) == 2

        started = time.monotonic()
        with pytest.raises(ProviderError, match=r"0.5 s request timeout \(after 2 attempts\)") as hang:
            connect("openai:stuck", settings).complete("s", [_user("u")], max_tokens=16)
        assert time.monotonic() - started < 10 and not hang.value.fatal

        with pytest.raises(ProviderError, match="API key was refused") as refused:
            connect("openai:bad-key", settings).complete("s", [_user("u")], max_tokens=16)
        assert refused.value.fatal and len(server.requests_for("bad-key")) == 1  # not retried


def test_generate_and_agent_take_the_sandbox_level_and_required_stops_them_before_any_model_call(
        capsys, keys, monkeypatch, tmp_path):
    from types import SimpleNamespace

    import pkb.generate.agent
    import pkb.generate.sampler
    from pkb.runtime import sandbox

    def check(level, mode):
        if level == "required":
            raise sandbox.SandboxUnavailable("--sandbox required: missing landlock-fs (no Landlock in this kernel)")
        return sandbox.SandboxStatus(level, list(sandbox.PROTECTIONS), {})

    configs = []
    monkeypatch.setattr(sandbox, "check_sandbox", check)
    monkeypatch.setattr(pkb.generate.sampler, "generate", lambda problems, provider, settings, store, profile, config,
                        *rest: configs.append(config) or [])
    no_outcome = SimpleNamespace(to_dict=dict, stopped_by=None, best_step=None, steps=[], cost_usd=None,
                                 problem="allreduce", best_speedup=None)
    monkeypatch.setattr(pkb.generate.agent, "run_agent", lambda problem, provider, settings, store, profile, config,
                        *rest: configs.append(config) or no_outcome)
    with FakeModelServer({"coder": [Reply(GOOD)]}) as server:
        common = ["--model", "openai:coder", "--base-url", server.url + "/v1", "--db", str(tmp_path / "g.sqlite"),
                  "--out", str(tmp_path), *EVAL]
        code, _, err = run_cli(capsys, "generate", "--problems", "1", "--sandbox", "off", *common)
        assert code == 0 and "sandbox: off (candidates run unconfined" in err
        run_cli(capsys, "agent", "--problems", "1", "--sandbox", "off", "--json", *common)
        run_cli(capsys, "agent", "--problems", "1", *common)
        assert [config.sandbox for config in configs] == ["off", "off", "auto"]
        for command in (["generate", "--problems", "1"], ["agent", "--problems", "1"]):
            code, _, err = run_cli(capsys, *command, "--sandbox", "required", *common)
            assert code == 2 and "missing landlock-fs (no Landlock in this kernel)" in err
        assert len(configs) == 3 and server.requests == []  # refused before any model call


# -- pkb generate ---------------------------------------------------------------------------------------------


def test_generate_evaluates_records_everything_and_a_rerun_skips_what_is_done(capsys, keys, monkeypatch, tmp_path):
    db, out = tmp_path / "gen.sqlite", tmp_path / "runs"
    with FakeModelServer({"coder": [Reply(GOOD), Reply(WRONG), Reply(NO_CODE)]}) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.url + "/v1")  # the openai provider honours it
        args = ["generate", "--model", "openai:coder", "--problems", "allreduce", "--samples", "3", "--concurrency",
                "1", "--db", str(db), "--out", str(out), "--run", "r1", "--json", *EVAL]
        code, stdout, _ = run_cli(capsys, *args)
        rows = json.loads(stdout)
        assert [(r["problem"], r["sample"], r["status"]) for r in rows] == [
            ("allreduce", 0, "ok"), ("allreduce", 1, "mismatch"), ("allreduce", 2, "no_code")]
        assert code == 1  # not every sample is ok
        assert Path(rows[0]["code_path"]) == (out / "r1/allreduce/sample_0.py").resolve()
        assert Path(rows[0]["code_path"]).read_text() == GOOD_CODE

        stored = generations(db)
        assert [g["status"] for g in stored] == ["ok", "mismatch", "no_code"]
        assert all(g["response"] and g["tokens_in"] == 1000 and g["tokens_out"] == 200 for g in stored)
        assert "def reference(tensor)" in stored[0]["prompt"] and stored[0]["model"] == "openai:coder"
        assert stored[0]["code"] == GOOD_CODE and stored[2]["code"] is None and stored[2]["result_id"] is None
        verdicts = dict(sqlite3.connect(db).execute("SELECT id, status FROM results"))
        assert verdicts[stored[0]["result_id"]] == "ok" and verdicts[stored[1]["result_id"]] == "mismatch"

        calls = len(server.requests)
        code, stdout, _ = run_cli(capsys, *args)
        again = json.loads(stdout)
        assert len(server.requests) == calls  # nothing asked again
        assert [r["status"] for r in again] == ["ok", "mismatch", "no_code"] and all(r["resumed"] for r in again)
        assert len(generations(db)) == 3


def test_generate_retries_failed_calls_on_rerun_and_evaluates_no_eval_samples_later(capsys, keys, tmp_path):
    db, out = tmp_path / "gen.sqlite", tmp_path / "runs"
    scripts = {"flaky": [Reply("busy", status=429, headers=(("retry-after", "0"),)), Reply(GOOD)],
               "sleepy": [Reply(GOOD, delay_s=30), Reply(GOOD, delay_s=30), Reply(GOOD)]}
    with FakeModelServer(scripts) as server:
        common = ["--problems", "1", "--db", str(db), "--out", str(out), "--base-url", server.url + "/v1",
                  "--request-timeout", "0.5", "--retries", "1", "--json", *EVAL]
        code, stdout, _ = run_cli(capsys, "generate", "--model", "vllm:flaky", "--no-eval", *common)
        assert code == 0 and json.loads(stdout)[0]["status"] == "generated"
        assert generations(db)[0]["attempts"] == 2 and generations(db)[0]["result_id"] is None

        code, stdout, _ = run_cli(capsys, "generate", "--model", "vllm:flaky", *common)  # now evaluate it
        assert code == 0 and json.loads(stdout)[0]["status"] == "ok"
        assert len(server.requests_for("flaky")) == 2  # evaluated from the stored code, no new call

        code, stdout, _ = run_cli(capsys, "generate", "--model", "vllm:sleepy", "--no-eval", *common)
        first = json.loads(stdout)[0]
        assert code == 1 and first["status"] == "api_error" and "request timeout" in first["message"]
        code, stdout, _ = run_cli(capsys, "generate", "--model", "vllm:sleepy", "--no-eval", *common)
        assert code == 0 and json.loads(stdout)[0]["status"] == "generated"
        assert [g["status"] for g in generations(db) if g["model"] == "vllm:sleepy"] == ["api_error", "generated"]


def test_generate_keeps_model_calls_within_the_concurrency_limit(capsys, keys, tmp_path):
    with FakeModelServer({"claude-haiku-4-5": [Reply(GOOD, delay_s=0.3)]}) as server:
        code, stdout, _ = run_cli(capsys, "generate", "--model", "anthropic:claude-haiku-4-5", "--problems", "1-3",
                                  "--samples", "2", "--concurrency", "2", "--no-eval", "--base-url", server.url,
                                  "--db", str(tmp_path / "c.sqlite"), "--out", str(tmp_path), "--json")
        rows = json.loads(stdout)
    assert code == 0 and len(rows) == 6 and {r["status"] for r in rows} == {"generated"}
    assert [(r["problem"], r["sample"]) for r in rows][:2] == [("allreduce", 0), ("allreduce", 1)]
    assert server.max_in_flight == 2
    assert all(r["cost_usd"] == pytest.approx((1000 * 1 + 200 * 5) / 1e6) for r in rows)


# -- pkb agent ---------------------------------------------------------------------------------------------------


def test_agent_feeds_back_verdicts_keeps_the_best_file_and_resumes(capsys, keys, tmp_path):
    db, out = tmp_path / "agent.sqlite", tmp_path / "runs"
    with FakeModelServer({"refiner": [Reply(WRONG), Reply(GOOD), Reply(NO_CODE), Reply(BROKEN)]}) as server:
        args = ["agent", "--model", "openai:refiner", "--problems", "allreduce", "--base-url", server.url + "/v1",
                "--db", str(db), "--out", str(out), "--run", "a1", "--json", "--no-perf", *EVAL]
        code, stdout, _ = run_cli(capsys, *args, "--steps", "3")
        [outcome] = json.loads(stdout)
        assert code == 0
        assert [s["status"] for s in outcome["steps"]] == ["mismatch", "ok", "no_code"]
        assert outcome["best_step"] == 1 and Path(outcome["best_path"]).read_text() == GOOD_CODE

        sent = server.requests_for("refiner")
        second, third = sent[1]["messages"], sent[2]["messages"]
        assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
        assert second[2]["content"] == WRONG
        assert "**mismatch**" in second[3]["content"] and "rank" in second[3]["content"]
        assert "elements off" in second[3]["content"]
        assert "**ok**" in third[5]["content"] and "correct on every rank" in third[5]["content"]

        code, stdout, _ = run_cli(capsys, *args, "--steps", "4")  # one more step: the conversation resumes
        [outcome] = json.loads(stdout)
        assert len(server.requests_for("refiner")) == 4
        fourth = server.requests_for("refiner")[3]["messages"]
        assert len(fourth) == 8 and "no ```python code block" in fourth[7]["content"]
        assert [s["status"] for s in outcome["steps"]] == ["mismatch", "ok", "no_code", "compile_error"]
        assert [s["resumed"] for s in outcome["steps"]] == [True, True, True, False]
        assert outcome["best_step"] == 1 and Path(outcome["best_path"]).read_text() == GOOD_CODE
    rows = [g for g in generations(db) if g["kind"] == "agent"]
    assert [g["step"] for g in rows] == [0, 1, 2, 3] and rows[3]["status"] == "compile_error"
    assert rows[1]["prompt"] == second[3]["content"]  # the transcript: each step's message and answer
    assert rows[1]["response"] == GOOD


def test_generate_and_agent_evaluate_on_a_ray_cluster(capsys, keys, monkeypatch, tmp_path, ray_cluster):
    """With --executor ray, samples are evaluated on the cluster while the model answers; the rows are
    those of a local run; the agent waits for each step's verdict there."""
    db, out = tmp_path / "gen.sqlite", tmp_path / "runs"
    with FakeModelServer({"coder": [Reply(GOOD), Reply(WRONG), Reply(NO_CODE), Reply(BROKEN)],
                          "refiner": [Reply(WRONG), Reply(GOOD)]}) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.url + "/v1")
        code, stdout, err = run_cli(capsys, "generate", "--model", "openai:coder", "--problems", "allreduce",
                                    "--samples", "4", "--concurrency", "4", "--db", str(db), "--out", str(out),
                                    "--run", "r1", "--json", "--executor", "ray", *EVAL)
        rows = json.loads(stdout)
        # four calls in flight: which sample got which answer is a race, the answers are not
        assert sorted(r["status"] for r in rows) == ["compile_error", "mismatch", "no_code", "ok"] and code == 1
        assert "executor" not in err  # --json: nothing but JSON on stdout, no chatter
        stored = generations(db)
        verdicts = dict(sqlite3.connect(db).execute("SELECT id, status FROM results"))
        assert sorted(verdicts[g["result_id"]] for g in stored if g["result_id"]) == ["compile_error", "mismatch", "ok"]
        assert all(g["status"] == verdicts.get(g["result_id"], g["status"]) for g in stored)

        code, stdout, _ = run_cli(capsys, "agent", "--model", "openai:refiner", "--problems", "allreduce", "--db",
                                  str(db), "--out", str(out), "--run", "a1", "--json", "--no-perf", "--steps", "2",
                                  "--executor", "ray", *EVAL)
        [outcome] = json.loads(stdout)
        assert code == 0 and [s["status"] for s in outcome["steps"]] == ["mismatch", "ok"]
        assert "**mismatch**" in server.requests_for("refiner")[1]["messages"][3]["content"]


# -- offline: replay:DIR ---------------------------------------------------------------------------------------


def test_replay_runs_generate_and_agent_end_to_end_offline(capsys, tmp_path, monkeypatch):
    """``--model replay:DIR`` needs no network and no key: a folder's files answer, by problem and by sample or
    step; a recorded run replays; a problem without a file is a no_replay_file; cpu mode's speedups say they are not
    GPU timings."""
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    answers, db, out = tmp_path / "answers", tmp_path / "replay.sqlite", tmp_path / "runs"
    answers.mkdir()
    (answers / "1_allreduce_a_wrong.py").write_text(WRONG.split("```python\n")[1].split("```")[0])
    (answers / "1_allreduce_b_right.py").write_text(GOOD_CODE)
    common = ["--db", str(db), "--out", str(out), "--json", *EVAL]

    code, stdout, _ = run_cli(capsys, "generate", "--model", f"replay:{answers}", "--problems", "1-2", "--samples",
                              "2", "--run", "offline", *common)
    rows = json.loads(stdout)
    assert code == 1 and [(r["problem"], r["sample"], r["status"]) for r in rows] == [
        ("allreduce", 0, "mismatch"), ("allreduce", 1, "ok"), ("allgather", 0, "no_replay_file"),
        ("allgather", 1, "no_replay_file")]
    assert "no file answers allgather sample 0" in rows[2]["message"] and rows[0]["cost_usd"] == 0.0
    assert Path(rows[1]["code_path"]).read_text() == GOOD_CODE

    code, stdout, _ = run_cli(capsys, "generate", "--model", f"replay:{out / 'offline'}", "--problems", "1",
                              "--samples", "2", "--run", "replayed", *common)
    assert [r["status"] for r in json.loads(stdout)] == ["mismatch", "ok"]  # the recorded run, replayed

    code, stdout, err = run_cli(capsys, "agent", "--model", f"replay:{answers}", "--problems", "1", "--steps", "2",
                                "--run", "refined", "--db", str(db), "--out", str(out), "--experiment", "week2", *EVAL)
    assert code == 0, err
    assert "allreduce step 0: mismatch" in err and "allreduce step 1: ok" in err
    assert "(cpu mode: not a GPU timing)" in err  # beside each speedup
    assert "best file from step 1" in stdout and "are not GPU timings" in stdout
    rows = [g for g in generations(db) if g["kind"] == "agent"]
    assert [(g["step"], g["status"], g["model"]) for g in rows] == [(0, "mismatch", f"replay:{answers}"),
                                                                    (1, "ok", f"replay:{answers}")]
    # the prompt describes the world size its answers are judged at (it said the profile's 8 at --world-size 2)
    judged = EVAL[EVAL.index("--world-size") + 1]
    said = re.compile(rf"imported once on each of the\s+{judged}\s+ranks")
    assert said.search(rows[0]["prompt"]), rows[0]["prompt"][:600]
    assert all(said.search(g["prompt"]) for g in generations(db) if g["kind"] != "agent")
    assert_the_agent_run_is_its_experiment_and_its_transcript_reads_back(capsys, db, rows, tmp_path)


def assert_the_agent_run_is_its_experiment_and_its_transcript_reads_back(capsys, db: Path, rows: list[dict], tmp_path):
    """The agent ran in experiment week2 (its files judged before in `default`: their verdicts stored again under
    week2, not judged again); the default report leaves it out, week2's has it; its turns read back in the terminal,
    as JSON and in the HTML report (issue 54)."""
    stored = sqlite3.connect(db).execute("SELECT experiment, solution FROM results ORDER BY id").fetchall()
    assert [solution for experiment, solution in stored if experiment == "week2"] == ["refined/step_0",
                                                                                      "refined/step_1"]
    code, stdout, _ = run_cli(capsys, "report", "--db", str(db), "--problems", "1", "--format", "json")
    assert code == 0 and "refined" not in json.loads(stdout)["groups"]
    assert any("also in this database: week2 (2 results)" in note for note in json.loads(stdout)["notes"])
    page = tmp_path / "week2.html"
    code, stdout, _ = run_cli(capsys, "report", "--db", str(db), "--problems", "1", "--format", "json",
                              "--experiment", "week2", "--html", str(page))
    document = json.loads(stdout)
    assert code == 0 and document["groups"] == [f"{rows[0]['model']}/refined"]
    assert document["experiments"] == ["week2"]
    section = re.search(r'<section class="run" id="run-refined".*?</section>', page.read_text(), re.S).group(0)
    assert re.findall(r'<div class="turn" data-step="(\d)" data-status="(\w+)">', section) == [("0", "mismatch"),
                                                                                               ("1", "ok")]

    code, stdout, _ = run_cli(capsys, "transcripts", "refined", "--db", str(db))
    assert code == 0 and stdout.startswith(f"== refined: allreduce (agent, 2 turns), model {rows[0]['model']}\n")
    turns = stdout.split("-- turn ")[1:]
    assert [turn.splitlines()[0] for turn in turns] == ["0", "1"]
    assert "sent (prompt)" in turns[0] and "sent (feedback)" in turns[1] and "**mismatch**" in turns[1]
    assert "  verdict: mismatch" in turns[0] and "  verdict: ok" in turns[1]
    assert "\u2026" in turns[0] and "--full shows them all" in turns[0]  # the long prompt, shortened, says so
    code, stdout, _ = run_cli(capsys, "transcripts", "refined", "--db", str(db), "--json")
    [transcript] = json.loads(stdout)
    assert [(t["sent"], t["answer"], t["status"]) for t in transcript["turns"]] == [
        (row["prompt"], row["response"], row["status"]) for row in rows]
    code, stdout, _ = run_cli(capsys, "transcripts", "--db", str(db))
    assert code == 0 and stdout.split() == ["refined", "replayed", "offline"]  # the latest first
    code, _, err = run_cli(capsys, "transcripts", "nosuch", "--db", str(db))
    assert code == 2 and "no run 'nosuch'" in err and "refined" in err


def _user(text: str):
    from pkb.generate.providers import Message

    return Message("user", text)


def test_a_refused_key_stops_the_run_with_a_usage_error(capsys, keys, tmp_path):
    with FakeModelServer({"m": [Reply("invalid x-api-key", status=401)]}) as server:
        code, _, err = run_cli(capsys, "generate", "--model", "anthropic:m", "--problems", "1-3", "--samples", "4",
                               "--concurrency", "1", "--no-eval", "--base-url", server.url,
                               "--db", str(tmp_path / "k.sqlite"), "--out", str(tmp_path))
        assert code == 2 and "API key was refused" in err and "invalid x-api-key" in err
        assert len(server.requests) == 1  # stopped at the first refusal, not once per sample


# -- the upstream benchmark's prompt (--prompt upstream), on a fixture with upstream's layout -------------

UPSTREAM_FIXTURE = REPO / "tests" / "fixtures" / "upstream_layout"


def test_generate_with_the_upstream_prompt_sends_it_and_records_which_prompt(capsys, keys, tmp_path):
    db, out = tmp_path / "gen.sqlite", tmp_path / "runs"
    with FakeModelServer({"m": [Reply(GOOD)]}) as server:
        common = ["--problems", "1", "--db", str(db), "--out", str(out), "--base-url", server.url + "/v1", "--json"]
        code, stdout, _ = run_cli(capsys, "generate", "--model", "vllm:m", "--no-eval", "--prompt", "upstream",
                                  "--upstream-dir", str(UPSTREAM_FIXTURE), "--run", "paper", *common)
        assert code == 0 and json.loads(stdout)[0]["status"] == "generated"
        code, _, _ = run_cli(capsys, "generate", "--model", "vllm:m", "--no-eval", "--run", "own", *common)
        assert code == 0
        sent = [body["messages"] for body in server.requests_for("m")]
    assert sent[0][0] == {"role": "system", "content": "SYSTEM default."}
    assert sent[0][1]["content"].startswith("STATEMENT: write CUDA-K.")
    rows = {row["run"]: row for row in generations(db)}
    assert rows["paper"]["prompt_kind"] == "upstream" and rows["paper"]["system"] == "SYSTEM default."
    assert rows["own"]["prompt_kind"] == "pkb" and not rows["own"]["prompt"].startswith("STATEMENT")
