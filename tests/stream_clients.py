"""A stream producer or consumer in a process of its own, for the integration tests that pause
(SIGSTOP) or kill (SIGKILL) one: it writes what it does, one line per event, to a file the test reads.

    python -m tests.stream_clients produce DIR_JSON STREAM LOG     # publishes m1, m2, ... one at a time
    python -m tests.stream_clients consume DIR_JSON STREAM LOG     # consumes, acks every message

Lines: "token T" once it holds the lease, "sent SEQ" before a publish, "confirmed SEQ" after, "got SEQ
REDELIVERED" for a delivery, "acked SEQ" once acknowledged, "refused CODE DETAILS" when the broker
refuses (then it exits).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from ringq.errors import RingqError
from services import cluster
from tests.clusters import connection


def _line(log: Path, text: str) -> None:
    with log.open("a") as out:
        out.write(text + "\n")
        out.flush()


async def produce(info: cluster.ClusterInfo, stream: str, log: Path) -> None:
    async with connection(info, retry_for=5.0) as conn:
        producer = await conn.stream_producer(stream, lease_ttl_ms=1000)
        _line(log, f"token {producer.fencing_token}")
        n = 0
        while True:
            n += 1
            _line(log, f"sent {(producer.fencing_token << 32) | n}")
            try:
                seq = await producer.publish(f"m{n}".encode())
            except RingqError as error:
                _line(log, f"refused {error.code.name} {error.details}")
                return
            _line(log, f"confirmed {seq}")
            await asyncio.sleep(0.005)


async def consume(info: cluster.ClusterInfo, stream: str, log: Path) -> None:
    async with connection(info) as conn:
        consumer = await conn.stream_consumer(stream, prefetch=20, lease_ttl_ms=1000)
        _line(log, f"token {consumer.fencing_token}")
        async for message in consumer:
            _line(log, f"got {message.stream_seq} {int(message.redelivered)}")
            await asyncio.sleep(0.002)
            message.ack()
            _line(log, f"acked {message.stream_seq}")


def main() -> None:
    role, directory, stream, log = sys.argv[1:5]
    info = cluster.load(directory)
    asyncio.run((produce if role == "produce" else consume)(info, stream, Path(log)))


if __name__ == "__main__":
    main()
