"""One correctness verdict through ``pkb serve`` against ``pkb eval`` as a whole command; then throughput
against concurrent clients. Prints measured numbers; asserts nothing.

Latency (issue 27's target: median <= 2.0 s in cpu mode at W = 2, default cases, on a 2-core machine):
the same file, one at a time, interleaved round by round so load drifts hit every arm alike:
  - ``cli``: ``pkb eval PROBLEM FILE --json`` (a new process, torch imported, rank groups started);
  - ``client``: ``pkb.client.Client.evaluate`` from this process (warm server);
  - ``cli --server``: ``pkb eval PROBLEM FILE --server URL --json`` as a whole command (no torch).
Throughput: evaluations per minute with 1, 2, 4, 8 client threads, each submitting ``--per-client``
files; every verdict is checked to be there exactly once (by job id and in the database) and the
server's resident memory is printed before and after.

    python benchmarks/serve_latency.py [--problem 2] [--file F] [--mode cpu] [--world-size 2] [--rounds 7]
        [--clients 1,2,4,8] [--per-client 4] [--parallel N] [--out FILE.json]
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

from pkb.client import Client

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
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


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
    parser.add_argument("--out")
    args = parser.parse_args()
    path = Path(args.file) if args.file else next(UPSTREAM.glob(f"{args.problem}_*.py"))
    source = path.read_text()
    options = ["--mode", args.mode, "--world-size", str(args.world_size), "--json"]
    scratch = Path(tempfile.mkdtemp(prefix="pkb-serve-bench-"))
    serve = [sys.executable, "-m", "pkb.cli", "serve", "--url-file", str(scratch / "url"), "--db",
             str(scratch / "served.sqlite"), "--max-queue", "256"]
    server = subprocess.Popen(serve + (["--parallel", str(args.parallel)] if args.parallel else []),
                              stderr=subprocess.PIPE, text=True)
    while not (scratch / "url").is_file() or not (scratch / "url").read_text().strip():
        if server.poll() is not None:
            raise SystemExit(server.stderr.read())
        time.sleep(0.2)
    url = (scratch / "url").read_text().strip()
    print(server.stderr.readline().strip())
    client = Client(url)
    client.evaluate(args.problem, source, mode=args.mode, world_size=args.world_size)  # warm: not measured
    arms: dict[str, list[float]] = {"cli": [], "client": [], "cli --server": []}
    statuses = set()
    for _ in range(args.rounds):
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
                            for arm, v in arms.items()}}
    for arm, values in arms.items():
        print(f"{arm:>13}: median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f}, "
              f"{len(values)} runs)")
    report["throughput"] = []
    for clients in [int(c) for c in args.clients.split(",")]:
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
        finished = [client.job(job_id, wait_s=900) for job_id in ids]
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
    server.terminate()
    server.wait(timeout=60)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
