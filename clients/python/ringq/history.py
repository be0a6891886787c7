"""A client's history: one JSON line per publish, confirm, nack, delivery and ack (docs/observability.md).

Responsible for: recording what the application saw, with the client's wall
clock, for the Spark lifecycle job (pipeline/) to check the guarantees
against. Guarantees: lines are written whole, in the order the events
happened in this process; `close()` flushes them. A recorder with no path
records nothing and costs one attribute test per event.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

HISTORY_ENV = "RINGQ_HISTORY"


class History:
    """Appends events to `path` (or $RINGQ_HISTORY; neither: records nothing)."""

    def __init__(self, path: str | os.PathLike[str] | None, client: str) -> None:
        target = path if path is not None else os.environ.get(HISTORY_ENV)
        self.client = client
        self.on = bool(target)
        self._lock = threading.Lock()
        self._file = None
        if target:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            # Open for the recorder's life, closed by close().
            self._file = Path(target).open("a", encoding="utf-8", buffering=1 << 16)  # noqa: SIM115

    def record(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"ts": time.time(), "event": event, "client": self.client, **fields}, separators=(",", ":"))
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")

    def flush(self) -> None:
        with self._lock:
            if self._file is not None and not self._file.closed:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
