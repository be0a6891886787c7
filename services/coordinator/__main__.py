"""Run the coordinator: python -m services.coordinator --listen HOST:PORT --db PATH [--ready-file PATH]."""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.coordinator.server import serve


def _address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.coordinator", description=__doc__)
    parser.add_argument("--listen", type=_address, default="127.0.0.1:7000", help="HOST:PORT (port 0: any)")
    parser.add_argument("--db", default="./coordinator.db", help="SQLite file (created if absent)")
    parser.add_argument("--ready-file", help="write the bound HOST:PORT here once listening")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")
    asyncio.run(serve(args.listen, args.db, args.ready_file))


if __name__ == "__main__":
    main()
