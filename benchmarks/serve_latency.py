"""One correctness verdict through ``pkb serve`` against ``pkb eval`` as a whole command; then throughput
against concurrent clients. Prints measured numbers; asserts nothing.

Latency (issue 27's target: median <= 2.0 s in cpu mode at W = 2, default cases, on a 2-core machine):
the same file, one at a time, interleaved round by round so load drifts hit every arm alike:
  - ``cli``: ``pkb eval PROBLEM FILE --json`` (a new process, torch imported, rank groups started);
  - ``client``: ``pkb.client.Client.evaluate`` from this process (warm server);
  - ``cli --server``: ``pkb eval PROBLEM FILE --server URL --json`` as a whole command (no torch).
Throughput: evaluations per minute with 1, 2, 4, 8 client threads, each submitting ``--per-client``
files; every verdict is checked to be there exactly once (by evaluation id and in the database) and the
server's resident memory is printed before and after.
Soak (``--soak N``): N more evaluations from ``--soak-clients`` threads, a correct, a wrong and a crashing
file in turn, with the light options (``--soak-cases``, one trial); the resident memory of the server and of
its whole process tree (its rank processes too) every tenth of the way, and every verdict checked: there
once, the expected one, and stored once.

    python benchmarks/serve_latency.py [--problem 2] [--file F] [--mode cpu] [--world-size 2] [--rounds 7]
        [--clients 1,2,4,8] [--per-client 4] [--parallel N] [--soak 1000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pkb.client import Client, ServerError

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = ROOT.parent / "shared" / "upstream" / "reference"


def timed(command: list[str]) -> tuple[float, dict]:
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - began
    try:
        return wall, json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(f"{' '.join(command)} printed no verdict (exit {done.returncode}):\n{done.stderr[-2000:]}")


def resident_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:  # gone meanwhile
        pass
    return 0.0


def tree_mib(root: int) -> tuple[float, int]:
    """Resident memory of ``root`` and every process below it (MiB), and how many processes that is."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return sum(resident_mib(pid) for pid in tree), len(tree)


WRONG_TAIL = "\n\n_right = solution\n\n\ndef solution(*args, **kwargs):\n    out = _right(*args, **kwargs)\n" \
             "    return out * 2 + 1 if hasattr(out, 'dtype') else out\n"
CRASH_TAIL = "\n\n\ndef solution(*args, **kwargs):\n    raise RuntimeError('a crashing sample')\n"


def soak(client: Client, args, source: str, server_pid: int, db: Path) -> dict:
    """``args.soak`` evaluations (correct, wrong, crashing in turn) from ``args.soak_clients`` threads."""
    samples = [("ok", source), ("mismatch", source + WRONG_TAIL), ("runtime_error", source + CRASH_TAIL)]
    light = {"mode": args.mode, "world_size": args.world_size, "cases": args.soak_cases, "trials": 1,
             "upstream_trials": 1, "solution_set": "soak"}
    lock, next_index, outcomes, memory = threading.Lock(), [0], {}, []
    began = time.monotonic()

    def worker() -> None:
        while True:
            with lock:
                index = next_index[0]
                next_index[0] += 1
            if index >= args.soak:
                return
            expected, text = samples[index % 3]
            try:
                status = client.evaluate(args.problem, text, name=f"soak-{index}", **light)["status"]
            except ServerError as exc:  # counted as a lost verdict, and the client goes on
                status = f"lost: {exc}"
            with lock:
                outcomes.setdefault(index, []).append((expected, status))
                done = len(outcomes)
                if done % max(args.soak // 10, 1) == 0:
                    tree, processes = tree_mib(server_pid)
                    memory.append({"evaluations": done, "server_mib": resident_mib(server_pid), "tree_mib": tree,
                                   "processes": processes, "elapsed_s": time.monotonic() - began})
                    print(f"  soak {done}/{args.soak}: server {memory[-1]['server_mib']:.0f} MiB, tree "
                          f"{memory[-1]['tree_mib']:.0f} MiB in {memory[-1]['processes']} processes, "
                          f"{memory[-1]['elapsed_s']:.0f} s", flush=True)

    threads = [threading.Thread(target=worker) for _ in range(args.soak_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - began
    with sqlite3.connect(db) as conn:
        stored = dict(conn.execute("SELECT solution, COUNT(*) FROM results WHERE solution_set = 'soak' GROUP BY solution"))
    wrong = {i: v for i, v in outcomes.items() if len(v) != 1 or v[0][0] != v[0][1]}
    report = {"evaluations": args.soak, "clients": args.soak_clients, "answered": len(outcomes),
              "unexpected_verdicts": len(wrong), "examples": dict(list(wrong.items())[:5]),
              "stored_once": sum(stored.get(f"soak-{i}") == 1 for i in range(args.soak)), "wall_s": wall,
              "per_minute": 60 * args.soak / wall, "memory": memory}
    print(f"soak: {args.soak} evaluations in {wall:.0f} s ({report['per_minute']:.1f}/min) from {args.soak_clients} "
          f"clients; answered {len(outcomes)}, unexpected verdicts {len(wrong)}, stored exactly once "
          f"{report['stored_once']}; server {memory[0]['server_mib']:.0f} -> {memory[-1]['server_mib']:.0f} MiB, "
          f"tree {memory[0]['tree_mib']:.0f} -> {memory[-1]['tree_mib']:.0f} MiB")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", default="2")
    parser.add_argument("--file", help="default: the upstream reference file of --problem")
    parser.add_argument("--mode", default="cpu")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--per-client", type=int, default=4)
    parser.add_argument("--parallel", type=int)
    parser.add_argument("--soak", type=int, default=0, help="evaluations of the soak (0: none)")
    parser.add_argument("--soak-clients", type=int, default=4)
    parser.add_argument("--soak-cases", default="tests")
    parser.add_argument("--skip-latency", action="store_true", help="throughput and soak only")
    parser.add_argument("--out")
    args = parser.parse_args()
    path = Path(args.file) if args.file else next(UPSTREAM.glob(f"{args.problem}_*.py"))
    source = path.read_text()
    options = ["--mode", args.mode, "--world-size", str(args.world_size), "--json"]
    scratch = Path(tempfile.mkdtemp(prefix="pkb-serve-bench-"))
    serve = [sys.executable, "-m", "pkb.cli", "serve", "--url-file", str(scratch / "url"), "--db",
             str(scratch / "served.sqlite"), "--max-queue", "256"]
    server_log = scratch / "serve.log"  # a file, not a pipe: a server that logs much never blocks on it
    with server_log.open("w") as log:
        server = subprocess.Popen(serve + (["--parallel", str(args.parallel)] if args.parallel else []),
                                  stderr=log, text=True)
    while not (scratch / "url").is_file() or not (scratch / "url").read_text().strip():
        if server.poll() is not None:
            raise SystemExit(server_log.read_text())
        time.sleep(0.2)
    url = (scratch / "url").read_text().strip()
    print(server_log.read_text().splitlines()[0])
    client = Client(url)
    client.evaluate(args.problem, source, mode=args.mode, world_size=args.world_size)  # warm: not measured
    arms: dict[str, list[float]] = {"cli": [], "client": [], "cli --server": []}
    statuses = set()
    for _ in range(0 if args.skip_latency else args.rounds):
        wall, result = timed([sys.executable, "-m", "pkb.cli", "eval", args.problem, str(path), *options])
        arms["cli"].append(wall)
        statuses.add(result["status"])
        began = time.monotonic()
        result = client.evaluate(args.problem, source, mode=args.mode, world_size=args.world_size)
        arms["client"].append(time.monotonic() - began)
        statuses.add(result["status"])
        wall, result = timed([sys.executable, "-m", "pkb.cli", "eval", args.problem, str(path), *options,
                              "--server", url])
        arms["cli --server"].append(wall)
        statuses.add(result["status"])
    report = {"problem": args.problem, "file": path.name, "mode": args.mode, "world_size": args.world_size,
              "machine": f"{os.cpu_count()} cores", "verdicts": sorted(statuses),
              "latency_s": {arm: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
                            for arm, v in arms.items() if v}}
    for arm, values in arms.items() if not args.skip_latency else ():
        print(f"{arm:>13}: median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f}, "
              f"{len(values)} runs)")
    report["throughput"] = []
    for clients in [int(c) for c in args.clients.split(",") if c]:
        rss_before = resident_mib(server.pid)
        ids: list[str] = []
        lock = threading.Lock()

        def one_client(index: int) -> None:
            for k in range(args.per_client):
                job = client.submit(args.problem, source, name=f"c{clients}-{index}-{k}", mode=args.mode,
                                    world_size=args.world_size, solution_set=f"throughput-{clients}")
                with lock:
                    ids.append(job["id"])

        began = time.monotonic()
        threads = [threading.Thread(target=one_client, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        finished = [client.evaluation(evaluation_id, wait_s=900) for evaluation_id in ids]
        wall = time.monotonic() - began
        with sqlite3.connect(scratch / "served.sqlite") as db:
            stored = db.execute("SELECT COUNT(*) FROM results WHERE solution_set = ?", (f"throughput-{clients}",)).fetchone()[0]
        row = {"clients": clients, "evaluations": len(ids), "unique_ids": len(set(ids)),
               "done": sum(job["state"] == "done" for job in finished), "stored": stored,
               "per_minute": 60 * len(ids) / wall, "wall_s": wall, "server_rss_mib": [rss_before, resident_mib(server.pid)],
               "verdicts": sorted({job["result"]["status"] for job in finished if job["result"]})}
        report["throughput"].append(row)
        print(f"{clients} client(s): {row['per_minute']:.1f} evaluations/min ({len(ids)} in {wall:.1f} s; done "
              f"{row['done']}, stored {stored}, ids unique {row['unique_ids']}); server RSS {rss_before:.0f} -> "
              f"{row['server_rss_mib'][1]:.0f} MiB; verdicts {row['verdicts']}")
    if args.soak:
        report["soak"] = soak(client, args, source, server.pid, scratch / "served.sqlite")
    server.terminate()
    server.wait(timeout=60)
    logged = server_log.read_text()
    errors = logged.count("Traceback")
    report["server_errors"] = errors
    print(f"server log: {errors} tracebacks" + (f"; its tail:\n{logged[-4000:]}" if errors else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
