"""Reaching the grader's machine over the network: a TCP connection to 127.0.0.1 and a connection to an
abstract unix socket, both opened by the test (``HINTS["tcp_port"]``, ``HINTS["abstract"]``); on each it
sends MARKER. The test's listeners record what arrives. (A real attacker would try the grader's own
rendezvous store, a container daemon, a cloud metadata service.)
"""

import socket


def connect(family: int, address, label: str, report: dict) -> None:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(3)
            sock.connect(address)
            sock.sendall(MARKER.encode())
        report["done"][label] = f"connected to {address!r}"
    except OSError as exc:
        report["failed"][label] = error_text(exc)


def reach_out() -> dict:
    report = new_report("network")
    if not armed():
        report["skipped"]["all"] = "disarmed"
        return report
    if HINTS.get("tcp_port"):
        connect(socket.AF_INET, ("127.0.0.1", HINTS["tcp_port"]), "tcp_loopback", report)
    if HINTS.get("abstract"):
        connect(socket.AF_UNIX, "\0" + HINTS["abstract"], "abstract_unix", report)
    return report


solution = attack_solution(reach_out)
