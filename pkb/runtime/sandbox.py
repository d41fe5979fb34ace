"""The parent's side of the sandbox every candidate process runs in (docs/threat-model.md, "Containment"): what a
sandbox level is, what this machine offers of it, and the plan a candidate group's jail carries out. The system calls
that carry the plan out, and what each protection enforces: pkb.runtime.confine.

A level (``--sandbox``, pkb.options.SANDBOX_LEVELS) asks for the protections of ``PROTECTIONS``, and on several
virtual nodes (pkb.topology) for those of ``NODE_PROTECTIONS`` between the nodes:

- ``auto`` (the default): each protection this machine offers, each on its own so that a kernel that lacks one
  still gets the others; every result says which ran and why the others did not (``SandboxStatus``);
- ``required``: the full set, or no evaluation (``SandboxUnavailable``, before any work);
- ``off``: none, candidates run unconfined (for debugging only).

``PKB_SANDBOX_SKIP`` leaves named protections out, to find which one breaks something on a new machine
(``skipped_protections``).

The machine is checked before any evaluation runs (``check_sandbox``, ``offered``): the kernel's Landlock ABI
(``landlock_abi``, ``LANDLOCK_NEEDS``), a system-call table for seccomp on this machine (``seccomp_arch``), pkb
running as root (the candidates' own uid), and the pid, network and mount namespaces with a private tmpfs, tried
once in a throw-away interpreter as the jail will (pkb.runtime.confine.try_namespaces).

The plan (``SandboxPlan``, ``new_plan``) is plain data decided here: the candidates' uid, where they may read
(``readable_paths``) and which devices they may use (``device_paths``), the limits (from the machine's size and W,
never its load) and the namespaces offered; on several nodes also a uid and a share of the group's limits for each
node (``for_nodes``, ``node_plan``). The system calls candidates never need are a table per machine (``seccomp_arch``).
``remove_tree`` removes a scratch directory after its group.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import glob
import os
import platform
import secrets
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pkb.kernels.build import meminfo_bytes
from pkb.options import SANDBOX_LEVELS

PROTECTIONS = {
    "landlock-fs": "writes only in the evaluation's scratch directory; reads only where software lives",
    "landlock-ioctl": "device ioctls only on the GPU and null/random devices",
    "landlock-scopes": "no signal, ptrace or abstract-socket connection outside the evaluation",
    "no-new-privs": "no privilege gained through execve",
    "seccomp": "no namespaces, mounts, ptrace, open_by_handle_at, bpf, perf events, kexec or keyrings",
    "separate-uid": "a uid of its own per evaluation when pkb runs as root",
    "pid-namespace": "every process it starts dies with the evaluation",
    "network-namespace": "a loopback of its own; nothing else reachable",
    "mount-namespace": "a private /proc, /dev/shm and System V IPC (an IPC namespace), a size-bounded scratch "
                       "directory",
    "rlimits": "process, file-size and core limits; the OOM killer picks candidates first",
}

# Between the virtual nodes of one evaluation (``SandboxStatus.nodes``; recorded only on several nodes)
NODE_PROTECTIONS = {
    "node-landlock": "each node its own Landlock domain: no ptrace, /proc/PID/fd, pidfd_getfd, signal or abstract "
                     "socket reaches another node; writes only in its own scratch directory",
    "node-uid": "each node its own uid: another node's processes, files and CUDA IPC handles are another user's",
    "node-pid-namespace": "each node its own pid namespace: another node's processes cannot be named (pidfd_open, "
                          "/proc, torch's pid-named fd channel)",
    "node-mount-namespace": "each node its own /dev/shm, System V IPC, /proc and scratch tmpfs, invisible to the "
                            "others",
}
NODE_SKIPPABLE = ("node-uid", "node-pid-namespace", "node-mount-namespace")  # PKB_SANDBOX_SKIP may name these

LANDLOCK_CREATE_RULESET = 444  # landlock_create_ruleset (include/uapi/linux/landlock.h): the same on every architecture
_CREATE_RULESET_VERSION = 1
CANDIDATE_UIDS = (1 << 30, 1 << 24)  # candidates get a uid in [base, base + span): unused by any account

# The /etc files Python, glibc and the toolchains read (the rest, e.g. shadow, stays unreadable).
ETC_READABLE = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "hosts", "host.conf", "nsswitch.conf",
                "passwd", "group", "resolv.conf", "gai.conf", "ssl", "ca-certificates", "ca-certificates.conf",
                "os-release", "debian_version", "alternatives", "mime.types", "protocols", "services",
                "nvidia", "OpenCL", "vulkan", "glvnd", "fonts", "timezone", "lsb-release", "redhat-release",
                "system-release", "pki", "crypto-policies", "environment")
SYSTEM_READABLE = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/opt", "/sys", "/proc")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class SandboxUnavailable(RuntimeError):
    """``--sandbox required`` on a machine that lacks part of the full set; the message says what."""


@dataclass
class SandboxStatus:
    """Which protections an evaluation's candidate processes ran under (``details.sandbox``)."""

    level: str
    enforced: list[str] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)
    nodes: dict | None = None  # on several nodes: {"count", "enforced", "missing"} of NODE_PROTECTIONS

    @property
    def full(self) -> bool:
        return (self.level != "off" and not self.missing and set(self.enforced) >= set(PROTECTIONS)
                and not (self.nodes or {}).get("missing"))

    def to_dict(self) -> dict:
        described = {"level": self.level, "full": self.full, "enforced": list(self.enforced),
                     "missing": dict(self.missing)}
        return {**described, "nodes": self.nodes} if self.nodes is not None else described

    @classmethod
    def off(cls) -> "SandboxStatus":
        return cls("off", [], {name: "--sandbox off" for name in PROTECTIONS})

    def describe(self) -> str:
        """One line, e.g. ``auto (full: landlock-fs, ...)`` or ``auto (partial; missing: name (why))``."""
        if self.level == "off":
            return "off (candidates run unconfined: for debugging only)"
        if self.full:
            return f"{self.level} (full: {', '.join(self.enforced + (self.nodes or {}).get('enforced', []))})"
        missing = {**self.missing, **(self.nodes or {}).get("missing", {})}
        return f"{self.level} (partial; missing: {'; '.join(f'{name} ({why})' for name, why in missing.items())})"


# -- what the kernel offers ---------------------------------------------------------------------------


LANDLOCK_NEEDS = {"landlock-fs": 3, "landlock-ioctl": 5, "landlock-scopes": 6}  # protection -> Landlock ABI
NOT_ROOT = ("pkb is not root: candidates run as your user (its own sockets, e.g. a session bus, stay reachable); "
            "run pkb as root for a uid of their own")


def landlock_missing(abi: int, name: str) -> str:
    """Why the Landlock protection ``name`` cannot be had on a kernel of ABI ``abi``."""
    if not abi:
        return "this kernel has no Landlock"
    return f"Landlock ABI {abi}, {name} needs {LANDLOCK_NEEDS[name]} (Linux 6.12+ with Landlock in the lsm= boot list)"


def seccomp_missing() -> str:
    return f"no syscall table for {platform.machine()}"


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 without Landlock."""
    if sys.platform != "linux":
        return 0
    abi = _libc.syscall(LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(int(abi), 0)


_NAMESPACE_NAMES = ("pid-namespace", "network-namespace", "mount-namespace")


@functools.lru_cache(maxsize=None)
def _namespaces_offered() -> dict[str, str | None]:
    """For each namespace protection: None if a child could set it up here, else why not (tried in a
    throw-away process, as the jail will; a fresh interpreter, not a fork, as the caller may have threads)."""
    if sys.platform != "linux":
        return {name: "not Linux" for name in _NAMESPACE_NAMES}
    if os.geteuid() != 0:
        return {name: "pkb is not root (run pkb as root for namespaces)" for name in _NAMESPACE_NAMES}
    package_root = str(Path(__file__).resolve().parents[2])
    probe = (f"import sys; sys.path.insert(0, {package_root!r}); "
             "from pkb.runtime.confine import try_namespaces; print(*try_namespaces())")
    try:
        done = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, timeout=60)
        codes = tuple(int(code) for code in done.stdout.split())
    except (OSError, ValueError, subprocess.TimeoutExpired):
        codes = ()
    if len(codes) != len(_NAMESPACE_NAMES):
        codes = (errno.EIO,) * len(_NAMESPACE_NAMES)
    return {name: (None if code == 0 else f"unshare/mount refused: {os.strerror(code)}")
            for name, code in zip(_NAMESPACE_NAMES, codes)}


def offered(level: str) -> SandboxStatus:
    """What ``level`` gives on this machine, before any evaluation runs."""
    if level == "off":
        return SandboxStatus.off()
    status = SandboxStatus(level)
    abi = landlock_abi()
    for name, version in LANDLOCK_NEEDS.items():
        if abi >= version:
            status.enforced.append(name)
        else:
            status.missing[name] = landlock_missing(abi, name)
    if sys.platform == "linux":
        status.enforced += ["no-new-privs"]
        if seccomp_arch() is not None:
            status.enforced.append("seccomp")
        else:
            status.missing["seccomp"] = seccomp_missing()
    else:
        status.missing.update({"no-new-privs": "not Linux", "seccomp": "not Linux"})
    if os.geteuid() == 0:
        status.enforced.append("separate-uid")
    else:
        status.missing["separate-uid"] = NOT_ROOT
    for name, why in _namespaces_offered().items():
        if why is None:
            status.enforced.append(name)
        else:
            status.missing[name] = why
    status.enforced.append("rlimits")
    return status


def check_sandbox(level: str, mode=None) -> SandboxStatus:
    """What ``level`` gives here; for ``required``, SandboxUnavailable unless it is the full set."""
    if level not in SANDBOX_LEVELS:
        raise ValueError(f"sandbox must be one of {SANDBOX_LEVELS}, got {level!r}")
    status = offered(level)
    if level == "required" and not status.full:
        missing = "; ".join(f"{name}: {why}" for name, why in status.missing.items())
        raise SandboxUnavailable(f"--sandbox required, but this machine lacks part of the sandbox ({missing}); "
                                 "run as root on Linux 6.12+ with Landlock enabled, or use --sandbox auto to "
                                 "evaluate with what is there (each result records what was enforced)")
    return status


# -- the plan a jail carries out ----------------------------------------------------------------------


@dataclass
class SandboxPlan:
    """Everything a jail needs, decided in the parent (plain data: it travels to the zygote pickled)."""

    level: str
    scratch: str  # the evaluation's private directory (created by the parent, owned by ``uid``)
    uid: int | None  # the candidate uid when pkb is root
    readable: list[str]
    devices: list[str]
    scratch_bytes: int
    shm_bytes: int
    max_processes: int
    max_file_bytes: int
    max_data_bytes: int | None  # cpu mode only (GPU drivers map large private regions)
    namespaces: dict[str, str | None]  # offered namespaces (None) or why not
    skip: tuple[str, ...] = ()  # protections left out on purpose (PKB_SANDBOX_SKIP, for diagnosis)
    num_nodes: int = 1  # the virtual nodes its ranks are split into, each a domain of its own (``for_nodes``)
    node_uids: tuple[int, ...] = ()  # each node's uid when pkb is root

    @property
    def root(self) -> bool:
        return self.uid is not None


def new_plan(level: str, scratch: str, world_size: int, cpu_mode: bool, cache_roots: list[str]) -> SandboxPlan:
    """The plan for one candidate group with ``scratch`` as its writable directory."""
    uid = CANDIDATE_UIDS[0] + secrets.randbelow(CANDIDATE_UIDS[1]) if os.geteuid() == 0 else None
    # Every limit follows from the machine's size and W, never from its load (what is free now): a limit
    # that shrinks while other evaluations run would fail beside them what passes alone.
    memory = meminfo_bytes("MemTotal") or (16 << 30)
    return SandboxPlan(
        level=level, scratch=scratch, uid=uid, readable=readable_paths(cache_roots), devices=device_paths(),
        scratch_bytes=min(4 << 30, memory // 8), shm_bytes=max(64 << 20, memory // 4),
        max_processes=1024 + 256 * world_size, max_file_bytes=8 << 30,
        max_data_bytes=max(2 << 30, memory // (2 * world_size)) if cpu_mode else None,
        namespaces=_namespaces_offered(), skip=skipped_protections())


def skipped_protections() -> tuple[str, ...]:
    """The protections ``PKB_SANDBOX_SKIP`` (comma-separated names) leaves out: for finding which one
    breaks something on a new machine. Every result says what was left out and why."""
    names = tuple(n.strip() for n in os.environ.get("PKB_SANDBOX_SKIP", "").split(",") if n.strip())
    known = (*PROTECTIONS, *NODE_SKIPPABLE)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"PKB_SANDBOX_SKIP names unknown protections {unknown}; known: {', '.join(known)}")
    return names


_PATH_VARIABLES = ("PATH", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "CPATH", "LIBRARY_PATH")


def readable_paths(extra: list[str]) -> list[str]:
    """Where a candidate may read (and execute): the system, Python's and torch's directories, the
    toolkits on PATH, CUDA_HOME, pkb's own package (not the checkout around it), and ``extra``.
    Every group of a process asks the same: the answer is kept for as long as its inputs stay the same."""
    return list(_readable_paths(tuple(sys.path), tuple(os.environ.get(v, "") for v in _PATH_VARIABLES),
                                os.getcwd(), tuple(extra)))


@functools.lru_cache(maxsize=8)
def _readable_paths(search_path: tuple[str, ...], variables: tuple[str, ...], cwd: str,
                    extra: tuple[str, ...]) -> tuple[str, ...]:
    import pkb

    package = Path(pkb.__file__).resolve().parent
    checkout = package.parent
    paths = set(SYSTEM_READABLE) | {f"/etc/{name}" for name in ETC_READABLE} | {str(package)}
    paths |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    paths |= {value for key, value in sysconfig.get_paths().items() if key in ("stdlib", "platstdlib", "purelib",
                                                                                "platlib", "include", "scripts")}
    paths |= {entry for entry in search_path if entry and Path(entry).resolve() not in (checkout, Path(cwd).resolve())}
    for value in variables:
        paths |= {p for p in value.split(os.pathsep) if p and os.path.isabs(p)}
    paths |= {os.path.realpath(p) for p in paths} | _link_targets(search_path)  # Landlock sees the real paths
    home = Path.home().resolve()
    paths = {p for p in paths if os.path.isabs(p) and Path(p).resolve() not in (home, checkout, Path("/"))}
    # never the temporary directory or a folder above it (a script run from /tmp puts /tmp on sys.path): the
    # evaluations' scratch directories, and a group's nodes' without a mount namespace, are made there
    temporary = Path(tempfile.gettempdir()).resolve()
    paths = {p for p in paths if Path(p).resolve() not in (temporary, *temporary.parents)}
    paths |= set(extra)
    return tuple(sorted(p for p in paths if os.path.exists(p)))


def _link_targets(folders) -> set[str]:
    """Where the symbolic links directly inside ``folders`` lead (an environment whose site-packages
    links to packages installed elsewhere)."""
    targets = set()
    for folder in folders:
        try:
            entries = list(os.scandir(folder or "."))
        except OSError:
            continue
        targets |= {os.path.realpath(entry.path) for entry in entries if entry.is_symlink()}
    return targets


def device_paths() -> list[str]:
    """The device files candidates may open and ioctl: the GPU's and the null/zero/random ones."""
    return [p for p in (*DEVICES, *sorted(glob.glob("/dev/nvidia*"))) if os.path.exists(p)]


# -- virtual nodes: a domain of its own for each ------------------------------------------------------


def for_nodes(plan: SandboxPlan, num_nodes: int) -> SandboxPlan:
    """``plan`` for a group whose ranks are ``num_nodes`` virtual nodes: a uid for each node (when root), and
    no IMEX channel (``/dev/nvidia-caps-imex-channels``): its fabric handles are plain bytes that any process
    with a channel may import, the way multi-node NVLink shares memory between real nodes, which the
    machines pkb models (one NVLink domain per node) do not have."""
    if num_nodes <= 1:
        return plan
    uids = tuple(_fresh_uids(num_nodes, avoid=plan.uid)) if plan.root else ()
    return dataclasses.replace(plan, num_nodes=num_nodes, node_uids=uids,
                               devices=[path for path in plan.devices if "imex" not in path])


def _fresh_uids(count: int, avoid: int | None) -> list[int]:
    uids: list[int] = []
    while len(uids) < count:
        uid = CANDIDATE_UIDS[0] + secrets.randbelow(CANDIDATE_UIDS[1])
        if uid != avoid and uid not in uids:
            uids.append(uid)
    return uids


def node_scratch(scratch: str, node: int) -> str:
    """Node ``node``'s private directory inside the group's scratch directory (its name holds a '-': not importable)."""
    return f"{scratch}/pkb-node-{node}"


def node_plan(plan: SandboxPlan, node: int) -> SandboxPlan:
    """The plan node ``node`` of ``plan`` enters: its own scratch directory and uid, its share of the group's
    scratch space and process limit."""
    uid = plan.node_uids[node] if plan.root and "node-uid" not in plan.skip else plan.uid
    return dataclasses.replace(plan, scratch=node_scratch(plan.scratch, node), uid=uid,
                               scratch_bytes=max(64 << 20, plan.scratch_bytes // plan.num_nodes),
                               max_processes=max(256, plan.max_processes // plan.num_nodes))


def node_status(plan: SandboxPlan, entered: SandboxStatus, done: list[str]) -> dict:
    """``SandboxStatus.nodes`` of a node that set up ``done`` (pkb.runtime.confine.prepare_node) and entered
    ``entered``."""
    enforced, missing = list(done), {}
    if {"landlock-fs", "landlock-scopes"} <= set(entered.enforced):
        enforced.append("node-landlock")
    else:
        missing["node-landlock"] = ("needs landlock-fs and landlock-scopes: "
                                    + "; ".join(f"{name}: {entered.missing.get(name, 'left out')}"
                                                for name in ("landlock-fs", "landlock-scopes")
                                                if name not in entered.enforced))
    if plan.root and "node-uid" not in plan.skip:
        enforced.append("node-uid")
    for name in NODE_PROTECTIONS:
        if name in enforced or name in missing:
            continue
        if name in plan.skip:
            missing[name] = "left out by PKB_SANDBOX_SKIP"
        elif name == "node-uid":
            missing[name] = NOT_ROOT
        else:
            namespace = name.removeprefix("node-")
            missing[name] = plan.namespaces.get(namespace) or "could not be created"
    return {"count": plan.num_nodes, "enforced": sorted(enforced, key=list(NODE_PROTECTIONS).index),
            "missing": missing}


def remove_tree(path: str) -> None:
    """Remove a scratch directory, whatever a candidate did to its modes (never following its links)."""
    import shutil

    def unlock(function, target, _):  # every process of the evaluation is dead by now: nothing races us
        try:
            for folder in (os.path.dirname(target), target):
                if os.path.isdir(folder) and not os.path.islink(folder):
                    os.chmod(folder, 0o700)
            function(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=unlock)


# -- seccomp: the system calls candidates never need (pkb.runtime.confine.seccomp_program refuses them) ------

_SECCOMP = {  # machine: (AUDIT_ARCH, {syscall: number}) for the calls candidates never need
    "x86_64": (0xC000003E, dict(unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, chroot=161,
                                open_by_handle_at=304, kexec_load=246, kexec_file_load=320, bpf=321, userfaultfd=323,
                                perf_event_open=298, keyctl=250, add_key=248, request_key=249, ptrace=101,
                                open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
                                mount_setattr=442)),
    "aarch64": (0xC00000B7, dict(unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51,
                                 open_by_handle_at=265, kexec_load=104, kexec_file_load=294, bpf=280, userfaultfd=282,
                                 perf_event_open=241, keyctl=219, add_key=217, request_key=218, ptrace=117,
                                 open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
                                 mount_setattr=442)),
}


def seccomp_arch():
    return _SECCOMP.get(platform.machine()) if sys.platform == "linux" else None
