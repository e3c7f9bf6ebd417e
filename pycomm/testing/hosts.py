"""Several hosts on one Linux machine, for tests and benchmarks across hosts (root only).

A host is a network namespace plus a UTS namespace (its own hostname, so pycomm's
same-host detection, `pycomm.shm.host_identity`, tells hosts apart), with one interface,
`eth0`, addressed 10.77.0.<i+1>/24. Every host's `eth0` is a veth pair whose other end is
a port of one bridge, `br0`, in a "switch" namespace of its own: nothing is created in the
machine's own namespace, so interface names are fixed and several `Hosts` never collide.
`link_gbit` shapes each host's link in both directions with `tc tbf` (the host's egress
on `eth0`, its ingress on the switch port). There is no added delay: `netem` is not in
every kernel (not in the one this was written on), so latency is the veth/TCP stack's own,
tens of microseconds, far below a real network's.

    with Hosts(2, link_gbit=1.0) as hosts:
        results = hosts.run(my_module.rank_body, ranks_per_host=2, kwargs={"steps": 3})
        print(hosts.tx_bytes())

`run` (pycomm/testing/hosts_launch.py) starts each rank inside its host with torchrun's variables
(rank, world, local rank, MASTER_ADDR/MASTER_PORT on host 0, GLOO_SOCKET_IFNAME=eth0),
makes the env:// Gloo group, calls a module-level function and returns what every rank
returned; a command (`pycomm-bench ...`) runs the same way, and `spawn` starts any
command in a host (`torchrun`, once per host).

Teardown always runs: `close()` (the context manager, `atexit`) kills every process left
in the hosts and deletes the namespaces, which deletes the veths, the bridge and the
qdiscs with them. Names carry the creating process's pid (`pycomm-h<pid>-<n>-...`), so a
later `Hosts` removes what a killed run left behind (`remove_stale`).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from .hosts_launch import Launch, RankResult, RanksFailed

__all__ = ["Hosts", "Launch", "RankResult", "RanksFailed"]

UTS_DIR = "/run/pycomm-hosts"  # bind mounts of each host's UTS namespace
ETC_DIR = "/etc/netns"  # `ip netns exec` binds /etc/netns/<name>/hosts over /etc/hosts
PREFIX = "pycomm-h"
SUBNET = "10.77.0"
IFNAME = "eth0"
_counter = itertools.count()
_available: Optional[str] = None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {done.stderr.strip()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(netns: str) -> None:
    done = _ip("netns", "pids", netns, check=False)
    for pid in done.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _remove_uts(path: str) -> None:
    subprocess.run(["umount", path], capture_output=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _ours(name: str) -> Optional[int]:
    """The pid that created namespace or UTS file `name`, or None when not ours."""
    if not name.startswith(PREFIX):
        return None
    head = name[len(PREFIX):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def netns_names() -> list[str]:
    """Every network namespace pycomm's hosts hold on this machine (any process's)."""
    names = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in names if line.strip() and _ours(line.split()[0])]


def remove_stale() -> list[str]:
    """Remove namespaces and UTS files left by a process that no longer runs (its pid is
    gone; a reused pid only delays the removal); return their names."""
    removed = []
    for netns in netns_names():
        if not _pid_alive(_ours(netns)):
            _kill_netns_pids(netns)
            _ip("netns", "del", netns, check=False)
            removed.append(netns)
    for directory, remove in ((UTS_DIR, _remove_uts), (ETC_DIR, shutil.rmtree)):
        if os.path.isdir(directory):
            for name in os.listdir(directory):
                if _ours(name) is not None and not _pid_alive(_ours(name)):
                    remove(os.path.join(directory, name))
                    removed.append(name)
    return removed


def available() -> Optional[str]:
    """None when this machine can make hosts, else the reason it cannot (for a skip)."""
    global _available
    if _available is None:
        _available = _check_available() or ""
    return _available or None


def _check_available() -> Optional[str]:
    if os.geteuid() != 0:
        return "needs root (network and UTS namespaces)"
    for tool in ("ip", "tc", "nsenter", "unshare", "umount"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (iproute2 / util-linux)"
    try:
        with Hosts(1, link_gbit=1.0):
            pass
    except (RuntimeError, OSError) as e:
        return f"cannot make a host: {e}"
    return None


class Hosts:
    """`n` hosts joined by one switch; see the module docstring. A context manager."""

    available = staticmethod(available)

    def __init__(self, n: int, link_gbit: Optional[float] = None,
                 burst_bytes: Optional[int] = None):
        if not 1 <= n <= 250:  # one /24
            raise ValueError(f"Hosts: n must be in [1, 250], got {n}")
        self.n = n
        self.link_gbit = link_gbit
        self.burst_bytes = burst_bytes
        self.prefix = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.netns = [f"{self.prefix}-{i}" for i in range(n)]
        self.switch = f"{self.prefix}-sw"
        self.hostnames = [f"host{i}" for i in range(n)]
        self._uts = [os.path.join(UTS_DIR, name) for name in self.netns]
        self._runs = itertools.count()
        self._closed = True

    # -- topology ------------------------------------------------------------------------

    def __enter__(self) -> Hosts:
        self.open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def open(self) -> Hosts:
        remove_stale()
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        os.makedirs(UTS_DIR, exist_ok=True)
        # Each host resolves every host's name, as cluster DNS would (torchrun's c10d
        # rendezvous looks its own hostname up).
        hosts_file = "".join(f"{self.addr(i)} {self.hostnames[i]}\n" for i in range(self.n))
        for i, netns in enumerate(self.netns):
            os.makedirs(os.path.join(ETC_DIR, netns), exist_ok=True)
            with open(os.path.join(ETC_DIR, netns, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n{hosts_file}")
            # A name not in that file is not looked up on the machine's own DNS server
            # (which a host cannot reach, and which answers late or never on some
            # networks): its own loopback refuses at once.
            with open(os.path.join(ETC_DIR, netns, "resolv.conf"), "w") as f:
                f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            _ip("netns", "add", netns)
            _ip("-n", netns, "link", "set", "lo", "up")
            _ip("-n", netns, "link", "add", IFNAME, "type", "veth", "peer", "name", f"p{i}",
                "netns", self.switch)
            _ip("-n", netns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            _ip("-n", netns, "link", "set", IFNAME, "up")
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")
            with open(self._uts[i], "w"):
                pass
            done = subprocess.run(["unshare", f"--uts={self._uts[i]}", "hostname",
                                   self.hostnames[i]], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"unshare --uts: {done.stderr.strip()}")
            if self.link_gbit is not None:
                self._shape(i)

    def _shape(self, i: int) -> None:
        """tbf at `link_gbit` on both ends of host i's link. The default burst is 1 ms at
        the rate (at least 64 KiB, one TSO segment): tbf needs a burst of at least a
        timer tick's worth of bytes to reach its rate."""
        rate_bit = self.link_gbit * 1e9
        burst = self.burst_bytes or max(64 * 1024, int(rate_bit / 8 * 1e-3))
        spec = ["root", "tbf", "rate", f"{int(rate_bit)}bit", "burst", str(burst),
                "latency", "50ms"]
        _tc("-n", self.netns[i], "qdisc", "add", "dev", IFNAME, *spec)
        _tc("-n", self.switch, "qdisc", "add", "dev", f"p{i}", *spec)

    def close(self) -> None:
        """Kill every process in the hosts, delete the namespaces (and with them the
        veths, bridge and qdiscs) and the UTS namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for netns in [*self.netns, self.switch]:
            _kill_netns_pids(netns)
        for netns in [*self.netns, self.switch]:
            _ip("netns", "del", netns, check=False)
        for path in self._uts:
            _remove_uts(path)
        for netns in self.netns:
            shutil.rmtree(os.path.join(ETC_DIR, netns), ignore_errors=True)
        atexit.unregister(self.close)

    # -- what a host is ----------------------------------------------------------------

    def addr(self, host: int) -> str:
        """Host `host`'s address on the switch."""
        return f"{SUBNET}.{host + 1}"

    def exec_argv(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside host `host`: its network (and its /sys/class/net and
        /etc/hosts, through `ip netns exec`) and its hostname."""
        return ["ip", "netns", "exec", self.netns[host], "nsenter", f"--uts={self._uts[host]}",
                "--", *argv]

    def spawn(self, host: int, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start `argv` in host `host` (a launcher such as torchrun, a helper process);
        `close()` kills it if it is still running."""
        return subprocess.Popen(self.exec_argv(host, argv), **popen_kwargs)

    def run_in(self, host: int, argv: Sequence[str], timeout: float = 30.0) -> str:
        """Run a short command in host `host` and return its stdout (raise on failure)."""
        done = subprocess.run(self.exec_argv(host, argv), capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{argv} in host {host}: {done.stderr.strip()}")
        return done.stdout

    # -- ranks -------------------------------------------------------------------------

    def start(self, target: Union[Callable[..., Any], str, Sequence[str]],
              ranks_per_host: int = 1, kwargs: Optional[dict] = None,
              group_timeout_s: float = 60.0, env: Optional[dict] = None) -> Launch:
        """Start `ranks_per_host` ranks in every host (ranks numbered host by host) and
        return the running Launch. `target`: a module-level function (or "module:name")
        called as `target(rank, world_size, **kwargs)` in an env:// Gloo group with
        `group_timeout_s`, whose return value comes back; or a command (a list of
        strings) run with torchrun's variables, whose output comes back."""
        port = 29500 + next(self._runs) % 1000  # the namespace is ours: no port is taken
        return Launch(self, target, ranks_per_host, port, kwargs or {}, group_timeout_s,
                      env or {})

    def run(self, target: Union[Callable[..., Any], str, Sequence[str]],
            ranks_per_host: int = 1, kwargs: Optional[dict] = None, timeout: float = 120.0,
            group_timeout_s: float = 60.0, env: Optional[dict] = None,
            check: bool = True) -> list[RankResult]:
        """`start(...)` and wait: every rank's RankResult, in rank order. Raises
        RanksFailed (every rank's exit and stderr tail) when a rank fails and `check`, or
        when the ranks outlive `timeout` seconds (they are killed first)."""
        return self.start(target, ranks_per_host, kwargs, group_timeout_s, env).wait(
            timeout, check)

    # -- the wire and faults ---------------------------------------------------------------

    def link_stats(self) -> list[dict[str, int]]:
        """Per host: bytes and packets its `eth0` sent and received so far."""
        stats = []
        for netns in self.netns:
            out = _ip("-j", "-s", "-n", netns, "link", "show", "dev", IFNAME).stdout
            s = json.loads(out)[0]["stats64"]
            stats.append({"tx_bytes": s["tx"]["bytes"], "rx_bytes": s["rx"]["bytes"],
                          "tx_packets": s["tx"]["packets"], "rx_packets": s["rx"]["packets"]})
        return stats

    def tx_bytes(self) -> list[int]:
        """Per host: bytes its `eth0` sent so far (Ethernet frames, headers included)."""
        return [s["tx_bytes"] for s in self.link_stats()]

    def link_down(self, host: int) -> None:
        """Cut host `host`'s link at the switch: its packets go nowhere, no peer is told."""
        _ip("-n", self.switch, "link", "set", f"p{host}", "down")

    def link_up(self, host: int) -> None:
        _ip("-n", self.switch, "link", "set", f"p{host}", "up")

    def kill_host(self, host: int) -> None:
        """SIGKILL every process in host `host` (as if it lost power, except that its
        kernel, which is the machine's, still closes their sockets)."""
        _kill_netns_pids(self.netns[host])

    def pids(self, host: int) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", self.netns[host]).stdout.split()]

    def wait_gone(self, host: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.pids(host) and time.monotonic() < deadline:
            time.sleep(0.02)
