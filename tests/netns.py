"""A private test network of Linux network namespaces, for fault tests that cut links between processes.

Responsible for: building, on request, one namespace per host plus a switch namespace holding a
bridge, each host joined to the bridge by a veth pair, on a private /24 of 10.213.0.0/16; running
processes inside a host's namespace; cutting a host off the switch and joining it again; cutting the
link between two hosts only (each still reaches every other host) and healing it; tearing it all
down.

Guarantees:
- Traffic stays inside the namespaces made here: nothing is created in the root namespace but an
  `unreachable` route for the test subnet, so a process there that dials a test address fails at
  once instead of leaving the machine. Never dial a test address from the root namespace: run the
  client inside a host's namespace (`popen` / `run`).
- Every host knows every other host's MAC address (permanent neighbour entries), so a cut link is a
  silent drop both ways, as a firewall's DROP or a dead switch port is: no ARP failure turns it into
  a fast "no route to host". A cut between two hosts is as silent: each addresses its frames for
  the other to a MAC address no host has (`void_mac`), which the switch floods and every host
  ignores; traffic between any other pair of hosts is untouched.
- `close()` (or leaving the `with` block) kills every process started here, deletes every
  namespace and removes the route, even after a failure half-way through `open()`; it is idempotent.
- Namespaces are named ringq-p-<pid>-<host> and the route has metric <pid>, with the pid of the test
  process; a later network deletes the namespaces and routes of test processes that are gone (a run
  that was killed before its cleanup), so none pile up. Concurrent networks get distinct subnets.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self

PREFIX = "ringq-p"
SUBNETS = "10.213"
SWITCH = "sw"
BRIDGE = "br0"
DEVICE = "eth0"  # a host's end of its veth pair, inside its namespace
_IP_TIMEOUT = 10.0
_KILL_WAIT = 5.0
_STALE_NAMESPACE = re.compile(rf"^{PREFIX}-(\d+)-")
_STALE_ROUTE = re.compile(r"^unreachable (\S+) metric (\d+)", re.MULTILINE)


class NetnsUnavailable(Exception):
    """This machine (or this user) cannot make network namespaces."""


@dataclass(frozen=True)
class Host:
    """One host of the test network: a namespace with one interface on the switch."""

    name: str
    namespace: str
    ip: str
    mac: str
    switch_port: str  # the switch's end of the host's veth pair, in the switch namespace


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be used here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=_IP_TIMEOUT)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=_IP_TIMEOUT)
    return None


def ip(*args: str, namespace: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `ip [-n namespace] args...`; RuntimeError with its stderr if it fails and `check`."""
    command = ["ip", *(("-n", namespace) if namespace else ()), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=_IP_TIMEOUT)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")
    return done


class TestNetwork:
    """Hosts `names` on a switch, on 10.213.<subnet>.0/24 (a free subnet is picked at `open`)."""

    __test__ = False  # not a pytest test class

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or SWITCH in names:
            raise ValueError(f"host names must be distinct and not {SWITCH!r}: {names}")
        self.names = list(names)
        self.tag = f"{PREFIX}-{os.getpid()}"
        self.subnet = ""  # "10.213.X.0/24" once open
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._route_added = False
        self._processes: list[subprocess.Popen[bytes]] = []
        self.void_mac = ""  # a MAC address no host has, once open: where frames across a cut pair go

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    @property
    def switch(self) -> str:
        return f"{self.tag}-{SWITCH}"

    # ------------------------------------------------------------------ building

    def open(self) -> None:
        """Build the network; on any failure tear down what was built and raise."""
        _delete_stale()
        try:
            third = self._claim_subnet()
            self.void_mac = f"02:13:{third:02x}:ff:ff:ff"
            self._add_namespace(self.switch)
            ip("link", "add", BRIDGE, "type", "bridge", namespace=self.switch)
            ip("link", "set", BRIDGE, "up", namespace=self.switch)
            for index, name in enumerate(self.names, start=1):
                host = Host(
                    name=name,
                    namespace=f"{self.tag}-{name}",
                    ip=f"{SUBNETS}.{third}.{10 + index}",
                    mac=f"02:13:{third:02x}:00:00:{index:02x}",
                    switch_port=f"p-{name}"[:15],
                )
                self._add_host(host)
                self.hosts[name] = host
            for host in self.hosts.values():
                for other in self.hosts.values():
                    if other is not host:
                        _point(host, other, other.mac)
        except BaseException:
            self.close()
            raise

    def _claim_subnet(self) -> int:
        """Pick a /24 no other test network uses: the root namespace's unreachable route for it (metric: our
        pid) is the claim; a subnet with any other route is taken (a concurrent claim: both step back)."""
        start = os.getpid() % 250
        for offset in range(250):
            third = 1 + (start + offset) % 250
            subnet = f"{SUBNETS}.{third}.0/24"
            if ip("route", "show", "exact", subnet).stdout.strip():
                continue
            ip("route", "add", "unreachable", subnet, "metric", str(os.getpid()))
            self.subnet, self._route_added = subnet, True
            if len(ip("route", "show", "exact", subnet).stdout.strip().splitlines()) == 1:
                return third
            self._remove_route()
        raise RuntimeError(f"no free /24 under {SUBNETS}.0.0/16 (every one has a route in the root namespace)")

    def _remove_route(self) -> None:
        if self._route_added:
            ip("route", "delete", "unreachable", self.subnet, "metric", str(os.getpid()), check=False)
            self._route_added = False

    def _add_namespace(self, namespace: str) -> None:
        made = ip("netns", "add", namespace, check=False)
        if made.returncode != 0:
            raise NetnsUnavailable(f"`ip netns add {namespace}` failed: {made.stderr.strip()}")
        self._namespaces.append(namespace)
        ip("link", "set", "lo", "up", namespace=namespace)

    def _add_host(self, host: Host) -> None:
        self._add_namespace(host.namespace)
        ip("link", "add", host.switch_port, "type", "veth", "peer", "name", DEVICE, "address", host.mac,
           "netns", host.namespace, namespace=self.switch)  # fmt: skip
        ip("link", "set", host.switch_port, "master", BRIDGE, "up", namespace=self.switch)
        ip("addr", "add", f"{host.ip}/24", "dev", DEVICE, namespace=host.namespace)
        ip("link", "set", DEVICE, "up", namespace=host.namespace)

    # ------------------------------------------------------------------ faults

    def cut(self, name: str) -> None:
        """Take `name`'s port off the bridge: every frame to or from it is dropped, silently."""
        ip("link", "set", self.hosts[name].switch_port, "nomaster", namespace=self.switch)

    def heal(self, name: str) -> None:
        """Put `name`'s port back on the bridge."""
        ip("link", "set", self.hosts[name].switch_port, "master", BRIDGE, namespace=self.switch)

    def cut_between(self, first: str, second: str) -> None:
        """Drop every frame between hosts `first` and `second`, silently, both ways; each of them still
        reaches every other host."""
        one, other = self._pair(first, second)
        _point(one, other, self.void_mac)
        _point(other, one, self.void_mac)

    def heal_between(self, first: str, second: str) -> None:
        """Undo `cut_between(first, second)`."""
        one, other = self._pair(first, second)
        _point(one, other, other.mac)
        _point(other, one, one.mac)

    def _pair(self, first: str, second: str) -> tuple[Host, Host]:
        if first == second:
            raise ValueError(f"a cut needs two distinct hosts, got {first!r} twice")
        return self.hosts[first], self.hosts[second]

    # ------------------------------------------------------------------ processes

    def popen(
        self, name: str, argv: Sequence[str], *, stdout: IO[bytes] | int, cwd: Path, env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        """Start `argv` inside host `name`'s namespace (its own session); `close()` kills it."""
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[name].namespace, *argv],
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout != subprocess.PIPE else None,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        self._processes.append(process)
        return process

    def run(
        self, name: str, argv: Sequence[str], *, cwd: Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside host `name`'s namespace to its end; its output as text."""
        return subprocess.run(
            ["ip", "netns", "exec", self.hosts[name].namespace, *argv],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            cwd=cwd,
            env=env,
            timeout=timeout,
        )

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        """SIGKILL one process started here (its session) and reap it."""
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(_KILL_WAIT)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Kill the processes, delete the namespaces, remove the route; never raises."""
        for process in self._processes:
            self.kill(process)
        self._processes.clear()
        for namespace in reversed(self._namespaces):
            _delete_namespace(namespace)
        self._namespaces.clear()
        self._remove_route()


def _point(host: Host, other: Host, mac: str) -> None:
    """In `host`'s namespace, send what is addressed to `other` to the MAC address `mac` (permanently)."""
    ip("neigh", "replace", other.ip, "lladdr", mac, "dev", DEVICE, "nud", "permanent", namespace=host.namespace)


def _delete_namespace(namespace: str) -> None:
    """Kill what still runs in `namespace` (by pid) and delete it; deleting it removes its veth ends too."""
    pids = ip("netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + _KILL_WAIT
    while pids and ip("netns", "pids", namespace, check=False).stdout.split() and time.monotonic() < deadline:
        time.sleep(0.02)
    ip("netns", "delete", namespace, check=False)


def _delete_stale() -> None:
    """Delete the namespaces and routes of earlier test processes that are gone (a run killed before its cleanup)."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        namespace = line.split()[0] if line.split() else ""
        match = _STALE_NAMESPACE.match(namespace)
        if match is not None and not _alive(int(match.group(1))):
            _delete_namespace(namespace)
    routes = ip("route", "show", "type", "unreachable", "root", f"{SUBNETS}.0.0/16", check=False).stdout
    for subnet, pid in _STALE_ROUTE.findall(routes):
        if not _alive(int(pid)):
            ip("route", "delete", "unreachable", subnet, "metric", pid, check=False)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
