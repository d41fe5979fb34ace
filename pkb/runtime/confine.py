"""The child's side of the sandbox (docs/threat-model.md, "Containment"): the system calls with which a jail, its
keeper and a virtual node's first process confine candidate code. What a level is, what this machine offers and
the plan these calls carry out: pkb.runtime.sandbox.

A candidate group is started by a trusted *jail* process, forked from the zygote, and a *keeper*
below it that enters the sandbox and then forks the W ranks, so that all ranks of one evaluation share
one Landlock domain (they may signal each other and share abstract sockets, as NCCL and symmetric memory
need, and nothing outside):

    zygote ── jail (trusted: tears the tree down on request) ── keeper (sandboxed; pid 1 of its own
              pid namespace where the kernel allows) ── rank 0 .. rank W-1 (candidate code)

What is enforced, each on its own so that a kernel that lacks one still gets the others (``auto``):

- ``landlock-fs``: writes only in the evaluation's scratch directory and /dev/shm; reads only where
  Python, torch, the toolkits and the system live (pkb's package too, read-only), never the checkout,
  the results database or the home directory. Landlock, ABI 3 or later.
- ``landlock-ioctl``: device ioctls only on /dev/nvidia* and the null/zero/random devices (ABI 5).
- ``landlock-scopes``: no signal to, and no abstract-socket connection with, a process outside the
  evaluation (ABI 6). Landlock also forbids ptrace (and so /proc/PID/mem) of any process outside.
- ``no-new-privs`` and ``seccomp``: no privilege through execve; no namespaces, mounts, ptrace,
  open_by_handle_at, bpf, perf events, kexec or keyrings.
- ``separate-uid``: when pkb runs as root, candidates run as a uid of their own (a fresh one per
  evaluation) with no capability but reading files (CAP_DAC_READ_SEARCH, limited by Landlock's rules):
  root's sockets (a container daemon, an init system) and files stay out of reach, and the process
  limit holds (the kernel does not apply RLIMIT_NPROC to root).
- ``pid-namespace``: the keeper is pid 1 of a pid namespace; when it dies the kernel kills every
  process in it, double-forked ``setsid`` children too. Without it, the jail is a child subreaper and
  kills every descendant that reaches it.
- ``network-namespace``: the ranks have a loopback of their own and reach nothing else; their
  rendezvous store runs in the keeper, inside.
- ``mount-namespace``: a private /proc (only the evaluation's processes), a private /dev/shm and a
  size-bounded scratch directory (tmpfs).
- ``rlimits``: a process limit (fork bombs), a file-size limit, no core files; in cpu mode a data
  limit (memory hogs); the OOM killer picks candidate processes first.

On several virtual nodes (pkb.topology) each node is a sandbox domain of its own inside the evaluation's,
so that nothing reaches another node's memory but the network (docs/topology.md, pkb.runtime.sandbox.NODE_PROTECTIONS):

    jail ── keeper (the group's namespaces, its store) ── node 0 ── its first process (pid 1 of ── its ranks
                                                      │             its own pid namespace)
                                                      └─ node 1 ── ...

Each node has its own scratch directory, temporary directory and ``NCCL_HOSTID`` always, and where the
machine allows: its own Landlock domain (``node-landlock``: ptrace, ``/proc/PID/fd``, ``pidfd_getfd``,
signals and abstract sockets stop at the node), its own uid (``node-uid``: the CUDA driver hands a legacy
IPC handle's memory to a client of the same user only, as its security-token share policy reads), its own
pid namespace (``node-pid-namespace``: another node's processes cannot be named) and its own mount namespace
(``node-mount-namespace``: its own /dev/shm and /proc, its scratch a tmpfs no other node sees). The nodes
share the group's network namespace: gloo and NCCL reach each other over its loopback.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import re
import resource
import struct
import sys
from pathlib import Path

from pkb.runtime.sandbox import (LANDLOCK_CREATE_RULESET, LANDLOCK_NEEDS, NOT_ROOT, PROTECTIONS, SandboxPlan,
                                 SandboxStatus, landlock_abi, landlock_missing, seccomp_arch, seccomp_missing)

# Landlock (include/uapi/linux/landlock.h); its ruleset is made with LANDLOCK_CREATE_RULESET
_ADD_RULE, _RESTRICT_SELF = 445, 446  # the same on every architecture
_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK = 1 << 8, 1 << 9, 1 << 10, 1 << 11
FS_MAKE_SYM, FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 12, 1 << 13, 1 << 14, 1 << 15
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
_FILE_ONLY = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # rights a file rule may hold
READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
DEVICE = FS_READ_FILE | FS_WRITE_FILE | FS_IOCTL_DEV

# namespaces, mounts, capabilities
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWUSER = 0x00020000, 0x20000000, 0x40000000, 0x10000000
CLONE_NEWIPC = 0x08000000
# The mount namespace comes with an IPC namespace of its own: /dev/shm (POSIX shared memory) is the mount's, System V
# shared memory, semaphores and message queues the IPC namespace's; without it a segment made with mode 0666 outlived
# the evaluation and reached the next one (another uid) and another virtual node (a red-team probe, issue 56).
PRIVATE_SHARED_MEMORY = CLONE_NEWNS | CLONE_NEWIPC
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
MS_RDONLY, MS_REMOUNT, MS_NOATIME, MS_BIND = 1, 32, 1 << 10, 1 << 12
_KEPT_MOUNT_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
PR_SET_PDEATHSIG, PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 1, 8, 38
PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 24, 36, 47, 2
CAP_DAC_READ_SEARCH = 2
PR_SET_DUMPABLE = 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class SandboxError(OSError):
    """A protection the plan asked for could not be applied (the evaluation is not started)."""


# -- the namespace probe (pkb.runtime.sandbox runs it in a throw-away interpreter) --------------------


def try_namespaces() -> list[int]:
    """In the probe's own process: the errno of unsharing each namespace (0: it worked)."""
    results = [0 if _libc.unshare(flag) == 0 else ctypes.get_errno()
               for flag in (CLONE_NEWPID, CLONE_NEWNET, PRIVATE_SHARED_MEMORY)]
    if results[2] == 0:
        results[2] = _try_mount_private_tmpfs()
    return results


def _try_mount_private_tmpfs() -> int:
    if _libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return ctypes.get_errno()
    if _libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m") != 0:
        return ctypes.get_errno()
    return 0


# -- the zygote, the jail and every process below them ---------------------------------------------


def set_dumpable(dumpable: bool) -> None:
    """A process that is not dumpable cannot be traced, nor its /proc files (environ, maps, mem) read,
    by any process without CAP_SYS_PTRACE, even one of the same user."""
    if sys.platform == "linux":
        _libc.prctl(PR_SET_DUMPABLE, int(dumpable), 0, 0, 0)


def become_subreaper() -> None:
    """Orphaned descendants of this process become its children (not init's), so it can end them all."""
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "become a child subreaper")


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (no orphaned ranks spinning forever)."""
    if sys.platform == "linux":
        _libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)


# -- carrying it out (in the jail and the keeper; trusted code, no candidate yet) ----------------------


def unshare_namespaces(plan: SandboxPlan) -> list[str]:
    """In the jail: new pid, network and mount namespaces where offered; their names."""
    done = []
    for name, flag in (("pid-namespace", CLONE_NEWPID), ("network-namespace", CLONE_NEWNET),
                       ("mount-namespace", PRIVATE_SHARED_MEMORY)):
        if name in plan.skip:
            continue
        if plan.namespaces.get(name, "no") is None and _libc.unshare(flag) == 0:
            done.append(name)
    return done


def prepare_keeper(plan: SandboxPlan, namespaces: list[str]) -> None:
    """In the keeper, still privileged: private mounts, loopback up, scratch layout, OOM preference."""
    if "mount-namespace" in namespaces:
        _mount_private(plan, proc="pid-namespace" in namespaces, whose="the group's")
    if "network-namespace" in namespaces:
        _loopback_up()
    for sub in scratch_dirs(plan.scratch).values():
        os.makedirs(sub, exist_ok=True)
        if plan.root:
            os.chown(sub, plan.uid, plan.uid)
    Path("/proc/self/oom_score_adj").write_text("1000")


def _mount_private(plan: SandboxPlan, proc: bool, whose: str) -> None:
    """In a new mount namespace: its mounts private, ``plan.scratch`` a size-bounded tmpfs of ``plan.uid``'s, a
    /dev/shm of its own and, with ``proc``, a /proc of this process's pid namespace."""
    _check(_libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), f"make {whose} mounts private")
    _without_access_times()
    owner = f",uid={plan.uid},gid={plan.uid}" if plan.root else ""
    _check(_libc.mount(b"tmpfs", plan.scratch.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                       f"size={plan.scratch_bytes},mode=0700{owner}".encode()), f"mount {whose} scratch tmpfs")
    _check(_libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV,
                       f"size={plan.shm_bytes},mode=1777".encode()), f"mount {whose} /dev/shm")
    if proc:
        _check(_libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), f"mount {whose} /proc")


def _without_access_times() -> None:
    """Every mount of this (new) mount namespace ``noatime``, its other flags kept: reading a file then leaves no mark
    another evaluation can see (with ``relatime``, a read sets the access time of a file last read over a day ago,
    which a later evaluation under another uid read back as bits: a red-team of issue 56). The machine's own mounts
    keep theirs. A mount that refuses is left as it is."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        fields = line.split()
        if len(fields) < 6:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[4])
        kept = sum(flag for name, flag in _KEPT_MOUNT_FLAGS.items() if name in fields[5].split(","))
        _libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_NOATIME | kept, None)


def scratch_dirs(scratch: str) -> dict[str, str]:
    """The environment variables that point into the scratch directory, and where. Every folder's name
    holds a '-', so none can be imported: a scratch directory on a candidate's import path (its working
    directory) never shadows a package (a folder ``triton`` there made ``import triton`` find an empty
    namespace package where Triton is not installed, and ``torch._dynamo`` fail to import)."""
    return {name: f"{scratch}/pkb-{folder}" for name, folder in (
        ("HOME", "home"), ("TMPDIR", "tmp"), ("TORCH_EXTENSIONS_DIR", "torch-extensions"),
        ("TRITON_CACHE_DIR", "triton-cache"), ("CUDA_CACHE_PATH", "cuda-cache"), ("XDG_CACHE_HOME", "cache"),
        ("PKB_CANDIDATE_DIR", "candidate"))}


def candidate_environment(plan: SandboxPlan, namespaces: list[str], node: int | None = None) -> dict[str, str]:
    """What a sandboxed process's environment gets: caches and temporary files in its scratch directory,
    gloo and NCCL on the private loopback when there is one. On virtual nodes (``node``: the process's),
    ``NCCL_HOSTID`` names its node: NCCL takes ranks of different nodes for different hosts and joins them
    through its network transport, never through the peer memory or host memory a node does not share."""
    env = {**scratch_dirs(plan.scratch), "PYTHONDONTWRITEBYTECODE": "1", "USER": "pkb-candidate",
           "LOGNAME": "pkb-candidate"}
    if "network-namespace" in namespaces:
        env.update(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    if node is not None:
        env["NCCL_HOSTID"] = f"pkb-{os.path.basename(os.path.dirname(plan.scratch))}-node{node}"
    return env


def enter(plan: SandboxPlan, namespaces: list[str]) -> SandboxStatus:
    """In the keeper, last: limits, the uid, no_new_privs, Landlock and seccomp. Irreversible; inherited
    by every process the keeper forks. Raises SandboxError if a protection fails to apply."""
    status = SandboxStatus(plan.level, list(namespaces))
    for name in ("pid-namespace", "network-namespace", "mount-namespace"):
        if name not in namespaces:
            status.missing[name] = plan.namespaces.get(name) or "could not be created"
    wanted = lambda name: name not in plan.skip  # noqa: E731
    if wanted("rlimits"):
        _set_limits(plan)
        status.enforced.append("rlimits")
    if plan.root and wanted("separate-uid"):
        _become(plan.uid)
        status.enforced.append("separate-uid")
    elif not plan.root:
        status.missing["separate-uid"] = NOT_ROOT
    if wanted("no-new-privs") or not plan.root:  # Landlock needs it without CAP_SYS_ADMIN
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")
        status.enforced.append("no-new-privs")
    abi = landlock_abi()
    landlock = {name: version for name, version in LANDLOCK_NEEDS.items() if wanted(name)}
    for name, version in landlock.items():
        if abi >= version:
            status.enforced.append(name)
        else:
            status.missing[name] = landlock_missing(abi, name)
    if abi >= 3 and landlock:
        restrict_files(plan, abi, files="landlock-fs" in landlock, ioctl="landlock-ioctl" in landlock,
                       scopes="landlock-scopes" in landlock)
    if seccomp_arch() is None:
        status.missing["seccomp"] = seccomp_missing()
    elif wanted("seccomp"):
        _install_seccomp()
        status.enforced.append("seccomp")
    for name in plan.skip:
        if name in PROTECTIONS:  # the node protections are the nodes' to say (sandbox.node_status)
            status.missing[name] = "left out by PKB_SANDBOX_SKIP"
    status.enforced = sorted(set(status.enforced) - set(plan.skip), key=list(PROTECTIONS).index)
    return status


def restrict_files(plan: SandboxPlan, abi: int, files: bool = True, ioctl: bool = True, scopes: bool = True) -> None:
    """Landlock: ``plan.readable`` read-only, the scratch directory and /dev/shm writable, the devices
    usable, everything else out of reach; signals and abstract sockets scoped to the domain (ABI 6)."""
    handled = _FS_BY_ABI[max(v for v in _FS_BY_ABI if v <= abi)] if files else 0
    handled = handled if ioctl else handled & ~FS_IOCTL_DEV
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 and scopes else 0
    if not handled and not scoped:
        return
    attr = struct.pack("QQQ", handled, 0, scoped) if abi >= 6 else struct.pack("QQ", handled, 0)
    ruleset = _libc.syscall(LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    _check(-1 if ruleset < 0 else 0, "create a Landlock ruleset")
    try:
        for path in plan.readable if handled else ():
            _allow(ruleset, path, READ & handled)
        for path in (plan.scratch, "/dev/shm") if handled else ():
            _allow(ruleset, path, handled & ~FS_IOCTL_DEV)
        for path in plan.devices if handled else ():
            _allow(ruleset, path, DEVICE & handled)
        # The CUDA driver names its threads through /proc/self/task/TID/comm and fails to start if it
        # cannot. Nothing else there is writable: other processes' files need ptrace access (refused
        # by Landlock outside the domain), /proc/sys needs root.
        _allow(ruleset, "/proc", (READ | FS_WRITE_FILE | FS_TRUNCATE) & handled)
        _check(_libc.syscall(_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)), "enforce the Landlock ruleset")
    finally:
        os.close(ruleset)


def _allow(ruleset: int, path: str, access: int) -> None:
    if not access:
        return
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # gone since the plan was made: nothing to allow
    try:
        if not os.path.isdir(path):
            access &= _FILE_ONLY
        rule = struct.pack("=Qi", access, fd)  # struct landlock_path_beneath_attr is packed
        _check(_libc.syscall(_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), rule,
                             ctypes.c_uint32(0)), f"allow {path}")
    finally:
        os.close(fd)


def _set_limits(plan: SandboxPlan) -> None:
    limits = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, plan.max_file_bytes)]
    processes = plan.max_processes
    if not plan.root:  # the limit counts every process of this user: leave room for the ones running now
        processes += _processes_of(os.getuid())
    limits.append((resource.RLIMIT_NPROC, processes))
    if plan.max_data_bytes:
        limits.append((resource.RLIMIT_DATA, plan.max_data_bytes))
    for which, value in limits:
        soft, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def _become(uid: int) -> None:
    """Drop root for ``uid``, keeping only CAP_DAC_READ_SEARCH (ambient, so compilers it runs read too):
    Landlock's rules, not file modes, decide what it reads; it can write, signal and connect to nothing
    that root owns."""
    last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last_cap + 1):
        if cap != CAP_DAC_READ_SEARCH:
            _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop a capability from the bounding set")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    _check(_libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0), "keep capabilities across setuid")
    parent = os.getppid()
    os.setresuid(uid, uid, uid)
    die_with_parent()  # a change of uid clears the parent-death signal: the keeper outlived a SIGTERM'd pkb
    if os.getppid() != parent:  # the parent died before the signal was set again
        os._exit(1)
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    keep = 1 << CAP_DAC_READ_SEARCH
    data = struct.pack("6I", keep, keep, keep, 0, 0, 0)  # effective, permitted, inheritable (two words)
    _check(_libc.capset(header, data), "set capabilities")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH, 0, 0), "raise an ambient capability")


def _loopback_up() -> None:
    import fcntl
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, 0x8913, request))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(sock, 0x8914, struct.pack("16sH14x", b"lo", flags | 0x1 | 0x40))  # SIOCSIFFLAGS: UP, RUNNING


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise SandboxError(code, f"sandbox: could not {what}: {os.strerror(code)}")


# -- virtual nodes: a domain of its own for each -----------------------------------------------------


def node_pid_namespace(plan: SandboxPlan, namespaces: list[str]) -> bool:
    """In the process that forks a node's first one: a new pid namespace for the node's processes, where the
    group has one (root); whether it was made."""
    if "pid-namespace" not in namespaces or "node-pid-namespace" in plan.skip:
        return False
    return _libc.unshare(CLONE_NEWPID) == 0


def prepare_node(plan: SandboxPlan, node: int, namespaces: list[str], own_pids: bool) -> list[str]:
    """In a node's first process (``plan``: the node's, from sandbox.node_plan), still privileged: its own mount
    namespace where the group has one (a private /dev/shm, a /proc of its own pid namespace, its scratch a
    tmpfs the other nodes never see), its scratch layout owned by its uid, and its pids numbered apart from
    the other nodes' (``own_pids``: it is pid 1 of a pid namespace of its own). Returns the names of the
    node protections it set up (``NODE_PROTECTIONS``); sandbox.node_status says the rest."""
    done = ["node-pid-namespace"] if own_pids else []
    os.makedirs(plan.scratch, exist_ok=True)
    if ("mount-namespace" in namespaces and "node-mount-namespace" not in plan.skip
            and _libc.unshare(PRIVATE_SHARED_MEMORY) == 0):
        _mount_private(plan, proc=own_pids, whose="the node's")
        done.append("node-mount-namespace")
    if own_pids and "node-mount-namespace" in done:
        _number_pids_from(node * _pid_stride(plan.num_nodes))
    elif not own_pids:
        become_subreaper()  # its ranks' orphans come back to it, not to the group's keeper
    for folder in (plan.scratch, *scratch_dirs(plan.scratch).values()):
        os.makedirs(folder, exist_ok=True)
        if plan.root:
            os.chown(folder, plan.uid, plan.uid)
    if plan.root:
        os.chmod(plan.scratch, 0o700)
    return done


def _pid_stride(num_nodes: int) -> int:
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        pid_max = 32768
    return max(1000, min(1_000_000, pid_max // (num_nodes + 1)))


def _number_pids_from(last: int) -> None:
    """The next process of this pid namespace gets pid ``last`` + 1: two nodes' ranks never share a pid number,
    so a socket named after a peer's pid (torch's symmetric memory names its fd channel so) is never another
    node's rank's. A convenience: isolation holds without it."""
    if last <= 1:
        return
    try:
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(last))
    except OSError:
        pass


# -- seccomp ------------------------------------------------------------------------------------------

_CLONE = {"x86_64": 56, "aarch64": 220}
_CLONE3 = 435


def seccomp_program() -> bytes:
    """A classic-BPF filter: EPERM for the calls of this machine's table (``seccomp_arch``, pkb.runtime.sandbox), for
    clone with CLONE_NEWUSER and for other architectures' and x32's calls; ENOSYS for clone3 (its flags cannot be
    inspected; glibc falls back to clone), everything else allowed."""
    audit_arch, numbers = seccomp_arch()
    ld_abs, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    denied = sorted(numbers.values())
    jge = 0x35
    # another architecture's calls (i386 through int 0x80) and x32's numbers are refused outright
    program = [(ld_abs, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, eperm), (ld_abs, 0, 0, 0),
               (jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]
    body = [(jeq, 0, 1, number) for number in denied]  # patched below: jump to EPERM on a match
    clone = [(jeq, 0, 3, _CLONE[platform.machine()]), (ld_abs, 0, 0, 16), (jset, 0, 1, CLONE_NEWUSER),
             (ret, 0, 0, eperm), (ld_abs, 0, 0, 0)]
    tail = [(jeq, 0, 1, _CLONE3), (ret, 0, 0, enosys), (ret, 0, 0, allow), (ret, 0, 0, eperm)]
    instructions = program + body + clone + tail
    eperm_at = len(instructions) - 1
    start = len(program)
    for i, number in enumerate(denied):
        at = start + i
        instructions[at] = (jeq, eperm_at - at - 1, 0, number)
    return b"".join(struct.pack("HBBI", code, jt, jf, k) for code, jt, jf, k in instructions)


def _install_seccomp() -> None:
    program = seccomp_program()
    count = len(program) // 8
    buffer = ctypes.create_string_buffer(program)
    fprog = struct.pack("HxxxxxxQ", count, ctypes.addressof(buffer))
    _check(_libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0), "install the seccomp filter")  # SECCOMP_MODE_FILTER
