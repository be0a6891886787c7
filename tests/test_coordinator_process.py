"""The coordinator as a real process: acknowledged writes survive SIGKILL mid-burst (SQLite); two
coordinators share one ZooKeeper; bad arguments are refused with one line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import pytest

from services.coordinator.__main__ import main as coordinator_main
from services.coordinator.client import CoordinatorClient
from services.coordinator.group_table import AddMember, CreateGroup, Group, GroupMember, MarkMemberDead, Outcome

REPO = Path(__file__).resolve().parents[1]
ROOT = GroupMember("root", "n0")

pytestmark = pytest.mark.integration


def start(
    db: Path | None, ready: Path, listen: str, log: IO[bytes], store_args: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the coordinator (on the SQLite file `db`, or as `store_args` say) and wait for its bound address."""
    ready.unlink(missing_ok=True)
    command = [sys.executable, "-m", "services.coordinator", "--listen", listen, *store_args]
    if db is not None:
        command += ["--db", str(db)]
    proc = subprocess.Popen([*command, "--ready-file", str(ready)], cwd=REPO, stdout=log, stderr=log)
    deadline = time.monotonic() + 20
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"coordinator did not become ready (exit code {proc.wait()})")
        time.sleep(0.02)
    return proc, ready.read_text()


def wait_until(check: Callable[[], bool], seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Burst(threading.Thread):
    """Adds members to group g as fast as it can, recording the ones acknowledged APPLIED."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.acked: list[str] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._burst())
        except BaseException as exc:
            self.error = exc

    async def _burst(self) -> None:
        async with CoordinatorClient(self.address, timeout=2, retry_seconds=20) as client:
            k = 0
            while not self.stop.is_set():
                newcomer = GroupMember(f"m{k}", "n1")
                k += 1
                seen = await client.read_group("g")
                outcome, _ = await client.change_group("g", AddMember(seen.version, "root", newcomer))
                if outcome is Outcome.APPLIED:
                    self.acked.append(newcomer.id)


def members_on_disk(db: Path) -> tuple[list[str], int]:
    """Open the file directly (as SQLite recovery would): integrity must hold; returns g's ids and version."""
    raw = sqlite3.connect(db)
    try:
        assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        version, value = raw.execute("SELECT version, value FROM records WHERE kind = 'group' AND key = 'g'").fetchone()
        logged = raw.execute("SELECT COUNT(*) FROM changes WHERE kind = 'group' AND key = 'g'").fetchone()[0]
    finally:
        raw.close()
    assert logged == version  # every write of g is in the change log, atomically with it
    return [entry["id"] for entry in json.loads(value)["members"]], int(version)


def test_acknowledged_writes_survive_sigkill(tmp_path: Path) -> None:
    db, ready = tmp_path / "coordinator.db", tmp_path / "ready"
    with open(tmp_path / "coordinator.log", "wb") as log:
        proc, address = start(db, ready, "127.0.0.1:0", log)
        try:
            assert address.startswith("127.0.0.1:") and not address.endswith(":0")

            async def create() -> None:
                async with CoordinatorClient(address) as client:
                    assert (await client.change_group("g", CreateGroup(0, ROOT)))[0] is Outcome.APPLIED

            asyncio.run(create())
            burst = Burst(address)
            burst.start()
            wait_until(lambda: len(burst.acked) >= 40 or burst.error is not None)
            os.kill(proc.pid, signal.SIGKILL)  # mid-burst: the writer has a change in flight or about to be
            assert proc.wait() == -signal.SIGKILL
            acked_before_kill = list(burst.acked)

            ids, version = members_on_disk(db)
            assert set(acked_before_kill) <= set(ids)
            assert version == len(ids)  # create made version 1 with one member; each add bumped both

            # Same address: the writer has kept retrying and must carry on once the coordinator is back.
            proc, address_again = start(db, ready, address, log)
            assert address_again == address
            wait_until(lambda: len(burst.acked) >= len(acked_before_kill) + 20 or burst.error is not None)
            burst.stop.set()
            burst.join(30)
            assert not burst.is_alive()
            assert burst.error is None, repr(burst.error)

            async def read_members() -> list[str]:
                async with CoordinatorClient(address) as client:
                    group = await client.read_group("g")
                assert group.version == len(group.members)
                return [m.id for m in group.members]

            served = asyncio.run(read_members())
            assert set(burst.acked) <= set(served)
            assert len(served) == len(set(served))

            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0  # graceful stop
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ids, version = members_on_disk(db)
    assert ids == served
    assert version == len(ids)


def test_bad_arguments_exit_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.coordinator", "--listen", "nowhere"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "expected HOST:PORT, got 'nowhere'" in result.stderr


def test_two_coordinators_share_one_zookeeper(tmp_path: Path, zookeeper: str) -> None:
    """A change made through one coordinator is read at once through the other; either may die."""
    store_args = ["--store", "zookeeper", "--zookeeper", zookeeper, "--zookeeper-root", f"/test-{uuid.uuid4().hex}"]
    procs: list[subprocess.Popen[bytes]] = []
    with open(tmp_path / "coordinators.log", "wb") as log:
        try:
            for name in ("a", "b"):
                proc, address = start(None, tmp_path / f"ready-{name}", "127.0.0.1:0", log, store_args)
                procs.append(proc)
                (tmp_path / f"address-{name}").write_text(address)
            address_a, address_b = ((tmp_path / f"address-{n}").read_text() for n in ("a", "b"))
            a, b = GroupMember("a", "n1"), GroupMember("b", "n2")

            async def through_both() -> None:
                async with CoordinatorClient(address_a) as one, CoordinatorClient(address_b) as two:
                    assert await one.change_group("g", CreateGroup(0, ROOT)) == (
                        Outcome.APPLIED,
                        Group("g", 1, (ROOT,)),
                    )
                    assert await two.read_group("g") == Group("g", 1, (ROOT,))
                    assert (await two.change_group("g", AddMember(1, "root", a)))[0] is Outcome.APPLIED
                    # The same change decided from version 1 through the other coordinator: refused.
                    assert await one.change_group("g", AddMember(1, "root", b)) == (
                        Outcome.VERSION_CONFLICT,
                        Group("g", 2, (ROOT, a)),
                    )
                    await one.register_node("n1", "127.0.0.1:7001")
                    assert await two.list_nodes() == [("n1", "127.0.0.1:7001")]

            asyncio.run(through_both())
            os.kill(procs[0].pid, signal.SIGKILL)
            assert procs[0].wait() == -signal.SIGKILL

            async def survivor() -> None:
                async with CoordinatorClient(address_b) as two:
                    outcome, group = await two.change_group("g", MarkMemberDead(2, "a", "root"))
                    assert (outcome, group.version) == (Outcome.APPLIED, 3)

            asyncio.run(survivor())
            procs[1].send_signal(signal.SIGTERM)
            assert procs[1].wait(10) == 0
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--store", "etcd"], "argument --store: invalid choice: 'etcd'"),
        (["--store", "zookeeper"], "--store zookeeper needs --zookeeper HOST:PORT[,HOST:PORT...]"),
        (["--store", "zookeeper", "--zookeeper", "nowhere"], "expected HOST:PORT[,HOST:PORT...], got 'nowhere'"),
        (["--store", "zookeeper", "--zookeeper", "h:1,"], "expected HOST:PORT[,HOST:PORT...], got 'h:1,'"),
        (["--store", "zookeeper", "--zookeeper", "h:1", "--db", "c.db"], "--db applies only to --store sqlite"),
        (["--store", "zookeeper", "--zookeeper", "h:1", "--zookeeper-root", "ringq"], "absolute znode path"),
        (["--store", "zookeeper", "--zookeeper", "h:1", "--zookeeper-root", "/a//b"], "absolute znode path"),
        (["--zookeeper", "h:1"], "--zookeeper and --zookeeper-root apply only to --store zookeeper"),
        (["--zookeeper-root", "/x"], "--zookeeper and --zookeeper-root apply only to --store zookeeper"),
    ],
)
def test_bad_store_arguments_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        coordinator_main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m services.coordinator: error: "), err
    assert message in err
