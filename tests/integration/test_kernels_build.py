"""load_cuda's build locks, on the CPU: a C++-only extension (with_cuda=False) needs g++ and ninja, no GPU.

Each build runs in its own process, as a rank's does, with the extension cache in a temporary folder.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not shutil.which("g++") or not shutil.which("ninja"),
                                reason="building an extension needs g++ and ninja on PATH")

BUILD = """
import sys
from pkb.kernels.build import BuildError, load_cuda
try:
    module = load_cuda("pkb_test_add", "", cpp_sources=sys.argv[1], functions=["add_one"], with_cuda=False)
except BuildError as exc:
    print("BuildError:", exc)
    sys.exit(3)
print(module.add_one(41))
"""
GOOD = "int add_one(int x) { return x + 1; }"
BROKEN = "int add_one(int x) { return x + ; }"


def _start(source: str, cache) -> subprocess.Popen:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache)}
    return subprocess.Popen([sys.executable, "-c", BUILD, source], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_a_build_killed_half_way_does_not_block_the_next_one(tmp_path):
    first = _start(GOOD, tmp_path)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("pkb/*/lock")):  # torch's lock: the build has started
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)  # as a timeout kills a rank: no cleanup runs
    first.wait()
    assert list(tmp_path.glob("pkb/*/lock")), "the killed build left no lock behind: this test tests nothing"

    second = _start(GOOD, tmp_path)
    try:
        out, _ = second.communicate(timeout=300)  # before the fix: waited for the dead build's lock forever
    finally:
        os.killpg(second.pid, signal.SIGKILL) if second.poll() is None else None
    assert second.returncode == 0 and out.strip().splitlines()[-1] == "42", out


def test_every_rank_waiting_for_a_failed_build_gets_the_compiler_error(tmp_path):
    ranks = [_start(BROKEN, tmp_path) for _ in range(3)]
    outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    for rank, out in zip(ranks, outputs):
        assert rank.returncode == 3, out  # a BuildError (compile_error), not an ImportError or a hang
        assert "BuildError:" in out and "error" in out.split("BuildError:", 1)[1].lower()
