"""The candidates of tests/candidates/node_attacks (channels between virtual nodes) and tests/candidates/inter_node
(honest inter-node solutions), as tests/integration/test_node_isolation.py and benchmarks/node_isolation/run.py
(the same on a GPU) take them."""

from __future__ import annotations

import re
from pathlib import Path

CANDIDATES = Path(__file__).resolve().parents[1] / "candidates"
ATTACKS = CANDIDATES / "node_attacks"
HOST_CHANNELS = ("dev_shm_files", "tmp_files", "posix_shm", "sysv_shm", "abstract_socket", "pathname_socket",
                 "pidfd_getfd", "proc_fd", "process_vm")  # the sandbox's node domains stop them
FENCE_BYPASSES = ("fence_wrapped", "fence_cpp_rendezvous", "fence_workspace", "fence_empty_strided_p2p",
                  "fence_overload", "fence_unlisted_op")  # the fence names them: ``forbidden``
CUDA_CHANNELS = ("cuda_ipc_legacy", "symm_mem_raw")  # need a GPU (``REQUIRES = ("cuda",)``)
HONEST = {path.stem: path for path in sorted((CANDIDATES / "inter_node").glob("*.py"))}
INTER_NODE_PROBLEMS = ("hierarchical_allreduce", "hierarchical_alltoall", "kv_cache_transfer")


def node_attack(name: str, scope: str, folder: Path) -> Path:
    """A ``hierarchical_allreduce`` candidate file (in ``folder``) of channel ``name``, reaching every rank
    (``scope="world"``: across nodes) or the ranks of its own node (``"node"``) through it."""
    prelude = re.sub(r'^SCOPE = "world"', f'SCOPE = "{scope}"', (ATTACKS / "_prelude.py").read_text(), count=1,
                     flags=re.M)
    path = folder / f"hierarchical_allreduce_{name}_{scope}.py"
    path.write_text(prelude + "\n\n" + (ATTACKS / f"{name}.py").read_text())
    return path


def problem_of(honest: str) -> str:
    """The problem an honest candidate of tests/candidates/inter_node is for (its name begins with it)."""
    return next(slug for slug in INTER_NODE_PROBLEMS if honest.startswith(slug))
