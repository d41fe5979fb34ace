"""Generation's parts that need no model server: extracting the solution from an answer, ``pkb prompt`` (pkb's
prompt and the upstream benchmark's, on a fixture with upstream's layout), the feedback a verdict becomes, model
names and keys, and a database from before the generations table. Generation against real HTTP servers:
tests/integration/test_generate.py."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("anthropic")

from pkb.cli import main  # noqa: E402
from pkb.evaluate.result import SCHEMA_VERSION  # noqa: E402
from pkb.generate.extract import extract_solution  # noqa: E402
from pkb.generate.providers import ModelSpec, connect  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NO_CODE = "I would need to know more about the interconnect before writing this."
BROKEN = "```python\ndef solution(tensor):\n    return tensor.clone(\n```"


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


# -- extraction ---------------------------------------------------------------------------------------------


def test_extraction_keeps_the_last_block_that_defines_solution():
    answer = ("First the kernel:\n```cuda\n__global__ void k() {}\n```\nA draft:\n```python\ndef solution(x):\n"
              "    return 1\n```\nFinal:\n```py\nimport torch\n\ndef solution(x):\n    return x\n```\n"
              "Usage:\n```python\nprint(solution(3))\n```")
    extraction = extract_solution(answer)
    assert extraction.code == "import torch\n\ndef solution(x):\n    return x\n"
    assert extraction.num_blocks == 4 and extraction.syntax_error is None


def test_extraction_reports_no_code_syntax_errors_and_takes_unfenced_python():
    assert extract_solution(NO_CODE) is None
    assert extract_solution("```python\ndef helper():\n    pass\n```") is None
    broken = extract_solution(BROKEN)
    assert broken.code.startswith("def solution") and "line" in broken.syntax_error
    assert extract_solution("import torch\ndef solution(t):\n    return t\n").code.startswith("import torch")
    cut_off = extract_solution("```python\ndef solution(t):\n    return t")  # the answer ran out of tokens
    assert cut_off.code == "def solution(t):\n    return t\n"


# -- prompt --------------------------------------------------------------------------------------------------


def test_prompt_is_built_from_the_problem_the_profile_and_a_worked_example(capsys):
    code, out, _ = run_cli(capsys, "prompt", "allgather_gemm", "--world-size", "4", "--case", "odd")
    assert code == 0
    assert "def reference(A_local, B)" in out and "`solution(A_local, B)`" in out
    assert "rank 3: A_local=bfloat16[37, 6], B=bfloat16[24, 10]" in out  # per-rank shapes of the case
    assert "450 GB/s per direction" in out and "NVIDIA H200" in out  # the default profile's numbers
    assert "atol=" in out and "rtol=" in out
    assert "symmetric_buffer(" in out and "load_cuda(" in out  # the helpers and their signatures
    assert "1_allreduce_cuda_peer.py" in out and 'REQUIRES = ("cuda",)' in out  # worked example, output format

    code, out, _ = run_cli(capsys, "prompt", "1", "--backend", "triton", "--hardware", "pcie_gen4_x8")
    assert code == 0
    assert "7_reducescatter_triton.py" in out and "import triton" in out
    assert "32 GB/s per direction" in out and "not available here" in out  # PCIe profile: no NVLS
    assert "1_allreduce_cuda_peer" not in out  # a problem's prompt never holds its own shipped answer

    code, _, err = run_cli(capsys, "prompt", "1", "--hardware", "nope")
    assert code == 2 and "h200_sxm_x8" in err


def test_feedback_on_a_correct_file_shows_times_speedup_and_roofline():
    from pkb.evaluate.result import CaseTiming, EvalResult
    from pkb.generate.prompt import feedback
    from pkb.options import Status
    from pkb.registry import get_problem

    result = EvalResult(problem="allreduce", problem_version=1, solution="s", solution_sha256="h", status=Status.OK,
                        message="all outputs match", mode="cuda", speedup=1.5, roofline_fraction=0.42,
                        times_are_gpu_performance=True,
                        timings=[CaseTiming("bf16_1MiB", 20e-6, 10e-6, 0.01, 0.02, 2.0)])
    text = feedback(get_problem("allreduce"), 3, result)
    assert "step 3" in text and "**ok**" in text
    assert "bf16_1MiB: reference 20.0 us, yours 10.0 us, speedup 2.00x" in text
    assert "1.50x" in text and "42.0% of the hardware roofline" in text and "not GPU performance" not in text
    cpu = feedback(get_problem("allreduce"), 0, EvalResult(**{**result.__dict__, "mode": "cpu",
                                                                "times_are_gpu_performance": False}))
    assert "measured in cpu mode and are not GPU performance" in cpu


# -- models and keys -----------------------------------------------------------------------------------------


def test_a_missing_key_is_a_usage_error_before_any_work(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    db = tmp_path / "never.sqlite"
    code, _, err = run_cli(capsys, "generate", "--model", "openai:gpt-5", "--problems", "1", "--db", str(db))
    assert code == 2 and "set OPENAI_API_KEY" in err and not db.exists()
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    code, _, err = run_cli(capsys, "agent", "--model", "anthropic:claude-opus-4-5", "--problems", "1", "--db", str(db))
    assert code == 2 and "set ANTHROPIC_API_KEY" in err and not db.exists()
    code, _, err = run_cli(capsys, "generate", "--model", "gpt-5", "--problems", "1", "--db", str(db))
    assert code == 2 and "provider:model" in err


def test_model_spec_parsing():
    assert ModelSpec.parse("together:Qwen/Qwen3-Coder") == ModelSpec("together", "Qwen/Qwen3-Coder")
    assert str(ModelSpec.parse("vllm:org/model:tag")) == "vllm:org/model:tag"


def test_a_local_server_preset_needs_its_address(monkeypatch):
    from pkb.generate.providers import SetupError

    monkeypatch.delenv("VLLM_BASE_URL", raising=False)
    with pytest.raises(SetupError, match="set VLLM_BASE_URL"):
        connect("vllm:my-model")


# -- the generations table -----------------------------------------------------------------------------------


def test_a_schema_1_database_gains_the_generations_table_and_keeps_its_results(tmp_path):
    from pkb.store.db import MIGRATIONS, ResultStore

    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(MIGRATIONS[0])
    conn.execute("INSERT INTO results (run_key, problem, problem_version, solution, solution_sha256, status, message, "
                 "mode, world_size, num_trials, times_are_gpu_performance, collectives_used, hardware, pkb_version, "
                 "schema_version, created_at, wall_s, result_json) VALUES "
                 "('k', 'allreduce', 1, 's', 'h', 'ok', '', 'cpu', 2, 1, 0, '[]', '', '0', 1, 0, 0, '{}')")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    with ResultStore(path) as store:
        assert store.schema_version == SCHEMA_VERSION and store.has("k")
        generation_id = store.add_generation(dict(
            run="r", kind="sample", model="vllm:m", provider="vllm", problem="allreduce", problem_version=1, sample=0,
            step=0, backend="cuda", hardware="h200_sxm_x8", world_size=8, case_name="c", temperature=None,
            max_tokens=10, system="s", prompt="p", response="a", status="generated", attempts=1))
        store.set_generation_verdict(generation_id, "ok", 1, "k", float("inf"))
        (row,) = store.generations(run="r")
    assert row["status"] == "ok" and row["result_id"] == 1 and row["speedup"] is None and row["pkb_version"]


# -- the upstream benchmark's prompt (--prompt upstream), on a fixture with upstream's layout -------------

UPSTREAM_FIXTURE = REPO / "tests" / "fixtures" / "upstream_layout"
EXAMPLE_IN, EXAMPLE_OUT = "def solution(x):\n    return x\n", "def solution(x):\n    return x.clone()\n"


def test_the_upstream_prompt_is_assembled_as_upstreams_kernelgen_does(capsys):
    # the fixture's templates, put together by hand in upstream's order (options.generate_kernel.components)
    expected_user = "\n\n".join([
        "STATEMENT: write CUDA-K.",
        f"INTRO-FEW CUDA-K\n[First example] IN={EXAMPLE_IN} OUT={EXAMPLE_OUT} (CUDA-K)\n\n"
        f"[Example 2] IN={EXAMPLE_IN} OUT={EXAMPLE_OUT} (CUDA-K)",  # two examples: few-shot, unnamed one numbered
        "ARCH:\ndef solution(tensor):\n    return tensor  # reference 1",
        "PRECISION: BF-16",  # meta.default_precision; the empty hardware section left out
        "INSTRUCTION: keep solution(); answer in one python block.",
    ]) + ("\nThe generated file will be saved as: solutions_cuda/1_allreduce_cuda.py\n"
          "Produce the complete Python file contents for that path.")
    code, out, err = run_cli(capsys, "prompt", "1", "--prompt", "upstream", "--upstream-dir", str(UPSTREAM_FIXTURE))
    assert code == 0, err
    assert out == "SYSTEM default.\n\n" + expected_user + "\n"  # the system prompt: generate_kernel.py's constant

    from pkb.generate.prompt import load_profile
    from pkb.generate.upstream_prompt import prompt_for
    from pkb.registry import get_problem

    triton = prompt_for(get_problem("allgather_gemm_at"), "triton", load_profile(), kind="upstream",
                        upstream_dir=UPSTREAM_FIXTURE)
    assert triton.system == "SYSTEM for triton." and triton.kind == "upstream"  # the backend's own, stripped
    assert f"INTRO-ONE Triton-K\n[Only example] IN={EXAMPLE_IN}" in triton.user  # one example: one-shot
    assert "# reference 11" in triton.user and "solutions_triton/11_allgather_gemm_AT_triton.py" in triton.user


def test_the_upstream_prompt_says_what_is_missing(capsys, tmp_path):
    code, _, err = run_cli(capsys, "prompt", "1", "--prompt", "upstream")
    assert code == 2 and "--prompt upstream needs --upstream-dir" in err
    code, _, err = run_cli(capsys, "prompt", "1", "--prompt", "upstream", "--upstream-dir", str(tmp_path))
    assert code == 2 and "kernelgen/prompts.toml not found" in err and "clone of the upstream benchmark" in err
    code, _, err = run_cli(capsys, "prompt", "2", "--prompt", "upstream", "--upstream-dir", str(UPSTREAM_FIXTURE))
    assert code == 2 and "has no file for problem 2 (allgather)" in err
    code, _, err = run_cli(capsys, "prompt", "1", "--upstream-dir", str(UPSTREAM_FIXTURE))
    assert code == 2 and "--upstream-dir goes with --prompt upstream" in err


# -- replay:DIR ------------------------------------------------------------------------------------------------


def test_replay_picks_the_file_by_problem_and_by_sample_or_step(tmp_path):
    from pkb.generate.providers import CallContext, Message, SetupError, replay_file

    (tmp_path / "allgather").mkdir()
    recorded = tmp_path / "allgather" / "sample_1.py"
    recorded.write_text("def solution(tensor):\n    return tensor\n")
    first, second = tmp_path / "1_allreduce_a.py", tmp_path / "allreduce_b.py"
    first.write_text("# a")
    second.write_text("# b")
    assert replay_file(tmp_path, CallContext("allgather", 2, sample=1)) == recorded
    assert replay_file(tmp_path, CallContext("allgather", 2, sample=0)) is None
    assert replay_file(tmp_path, CallContext("allgather", 2, step=1, kind="step")) is None  # step files are agent's
    assert [replay_file(tmp_path, CallContext("allreduce", 1, step=k, kind="step")) for k in range(3)] == [
        first, second, second]  # in name order, the last one for every later step
    provider = connect(f"replay:{tmp_path}")
    answer = provider.complete("system", [Message("user", "write it")], 100, context=CallContext("allgather", 2,
                                                                                                  sample=1))
    assert answer.text == recorded.read_text() and answer.cost_usd == 0.0 and answer.attempts == 1
    with pytest.raises(SetupError, match="is not a folder"):
        connect(f"replay:{tmp_path / 'missing'}")


def test_a_missing_replay_file_is_its_own_status_that_names_the_file(capsys, tmp_path):
    """Not an ``api_error`` (issue 54.9): ``no_replay_file``, saying which file is missing; a rerun asks again, and the
    default run name says what ran (a folder's files, not judged under --no-eval: no backend, no mode)."""
    import json

    answers, out = tmp_path / "answers", tmp_path / "runs"
    answers.mkdir()
    (answers / "1_allreduce_mine.py").write_text("def solution(tensor):\n    return tensor\n")
    argv = ("generate", "--model", f"replay:{answers}", "--problems", "1-2,hierarchical_allreduce", "--no-eval",
            "--db", str(tmp_path / "replay.sqlite"), "--out", str(out), "--json")
    code, stdout, _ = run_cli(capsys, *argv)
    rows = {row["problem"]: row for row in json.loads(stdout)}
    assert code == 1 and [row["status"] for row in rows.values()] == ["generated", "no_replay_file", "no_replay_file"]
    assert rows["allgather"]["message"] == (
        f"no file answers allgather sample 0: {answers / 'allgather' / 'sample_0.py'} is missing, and {answers} holds "
        "no allgather.py or 2_<name>[_<backend>].py at its top (docs/generation.md, `replay:DIR`)")
    assert "holds no hierarchical_allreduce.py at its top" in rows["hierarchical_allreduce"]["message"]
    run_dir = Path(rows["allreduce"]["code_path"]).parent.parent
    assert run_dir.name == "replay-" + str(answers).strip("/").replace("/", "-")  # no backend asked, not judged

    (answers / "2_allgather_mine.py").write_text("def solution(tensor):\n    return tensor\n")
    code, stdout, _ = run_cli(capsys, *argv)
    assert [(row["status"], row["resumed"]) for row in json.loads(stdout)] == [
        ("generated", True), ("generated", False), ("no_replay_file", False)]  # asked again, answered now


def test_a_default_run_name_says_what_ran():
    from pkb.generate.sampler import default_run_name
    from pkb.options import Mode

    gpt5, answers = ModelSpec.parse("openai:gpt-5"), ModelSpec.parse("replay:runs/mine")
    assert default_run_name(gpt5, "cuda", Mode.CUDA, None) == "openai-gpt-5-cuda"
    assert default_run_name(gpt5, "triton", Mode.CUDA, 0.8) == "openai-gpt-5-triton-t0.8"
    assert default_run_name(gpt5, "cuda", Mode.CPU, None) == "openai-gpt-5-cuda-on-cpu"  # CUDA kernels, judged on CPU
    assert default_run_name(gpt5, "cuda", Mode.SHARED_GPU, None) == "openai-gpt-5-cuda-on-shared-gpu"
    assert default_run_name(gpt5, "cuda", None, None) == "openai-gpt-5-cuda"  # --no-eval: not judged anywhere
    assert default_run_name(answers, "cuda", Mode.CPU, None) == "replay-runs-mine-on-cpu"  # files answer, no backend
    assert default_run_name(answers, "cuda", Mode.CUDA, None) == "replay-runs-mine"


def test_the_summary_counts_only_answers_that_came_as_model_answers(tmp_path):
    """A missing replay file or an API error is asked again by a rerun and cost nothing: the summary's count of model
    answers and its cost leave them out, and says how many were asked without an answer."""
    from pkb.generate.cli import _summary
    from pkb.generate.sampler import GenStatus, SampleResult

    results = [SampleResult("allreduce", 0, "ok", tokens_in=10, tokens_out=20, cost_usd=0.5),
               SampleResult("allreduce", 1, "mismatch", tokens_in=10, tokens_out=30, cost_usd=0.25),
               SampleResult("allgather", 0, str(GenStatus.NO_REPLAY_FILE)),
               SampleResult("allgather", 1, str(GenStatus.API_ERROR)),
               SampleResult("broadcast", 0, "ok", tokens_in=5, tokens_out=5, cost_usd=1.0, resumed=True)]
    text = _summary(results, tmp_path, "r.sqlite")
    assert "5 samples" in text
    assert "this call: 2 model answers (2 asked, no answer), 20 tokens in, 50 out, $0.7500" in text, text
