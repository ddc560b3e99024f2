"""A second host on this machine, and a kernel black hole between it and Postgres.

``Partition`` makes a network namespace joined to this one by a veth pair:
``host_addr`` (this side) and ``guest_addr`` (the namespace's side). Services
the tests start listen on ``host_addr``, which processes on both sides reach;
a process started with ``guest_argv`` lives in the namespace, so its packets
cross the veth. ``black_hole(port)`` drops that traffic in the raw table's
PREROUTING chain on both ends of the pair: packets vanish, no RST, no FIN, the
sender's stack keeps retransmitting. ``heal()`` removes the rules.

Needs root, ``ip`` (iproute2) and ``iptables``; ``unavailable()`` says what is
missing so tests can skip loudly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence


def unavailable() -> str | None:
    """Why no partition can be made here (None when it can)."""
    if os.geteuid() != 0:
        return "network namespaces and iptables need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: iproute2, iptables)"
    probe = subprocess.run(["ip", "netns", "add", f"poimen-probe-{os.getpid()}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"poimen-probe-{os.getpid()}"], capture_output=True)
    return None


def _run(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


class Partition:
    def __init__(self) -> None:
        # The subnet's third octet: one range per xdist worker (two partition tests may
        # run at once), the pid within it.
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        n = 20 + (int(worker) % 4) * 50 + os.getpid() % 50 if worker.isdigit() \
            else os.getpid() % 200 + 20
        self.name = f"poimen-p{os.getpid()}"
        self.host_if, self.guest_if = f"pv{os.getpid()}a", f"pv{os.getpid()}b"
        self.host_addr, self.guest_addr = f"10.213.{n}.1", f"10.213.{n}.2"
        self._holes: list[list[str]] = []

    def create(self) -> Partition:
        _run("ip", "netns", "add", self.name)
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.guest_if)
        _run("ip", "link", "set", self.guest_if, "netns", self.name)
        _run("ip", "addr", "add", f"{self.host_addr}/30", "dev", self.host_if)
        _run("ip", "link", "set", self.host_if, "up")
        self._in("ip", "addr", "add", f"{self.guest_addr}/30", "dev", self.guest_if)
        self._in("ip", "link", "set", self.guest_if, "up")
        self._in("ip", "link", "set", "lo", "up")
        return self

    def _in(self, *argv: str) -> None:
        _run("ip", "netns", "exec", self.name, *argv)

    def guest_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace (same files, same users, other network)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def black_hole(self, port: int) -> None:
        """Silently drop every packet of the guest's TCP flows to ``host_addr:port``."""
        rules = [
            # guest -> host, dropped as it arrives on this side
            (None, ["-i", self.host_if, "-s", self.guest_addr, "-p", "tcp", "--dport", str(port)]),
            # host -> guest, dropped as it arrives in the namespace
            (self.name, ["-i", self.guest_if, "-d", self.guest_addr, "-p", "tcp",
                         "--sport", str(port)]),
        ]
        for netns, match in rules:
            prefix = ["ip", "netns", "exec", netns] if netns else []
            _run(*prefix, "iptables", "-t", "raw", "-I", "PREROUTING", *match, "-j", "DROP")
            self._holes.append([*prefix, "iptables", "-t", "raw", "-D", "PREROUTING", *match,
                                "-j", "DROP"])

    def heal(self) -> None:
        while self._holes:
            subprocess.run(self._holes.pop(), capture_output=True)

    def destroy(self) -> None:
        self.heal()
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
