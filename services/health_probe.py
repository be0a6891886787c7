"""Ask a ringq node's or coordinator's health service whether it serves (like grpc_health_probe):

    python -m services.health_probe HOST:PORT [--service NAME] [--timeout SECONDS]

HOST:PORT is the process's plaintext `--health-listen` port (services/health.py). Exit 0 when the answer
is SERVING; otherwise exit 1 with one line on stderr saying what came back (NOT_SERVING, or no answer
within the timeout). Bad usage exits 2. For container health checks (docker/compose.yaml) and by hand.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.arguments import OneLineParser, address_argument

DEFAULT_TIMEOUT_SECONDS = 3.0


def check(address: str, service: str = "", timeout: float = DEFAULT_TIMEOUT_SECONDS) -> str:
    """The status `address`'s health service gives for `service` ("SERVING", "NOT_SERVING", ...); raises
    grpc.RpcError if it does not answer within `timeout` seconds (or does not know the service)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True)
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return name


def problem(address: str, service: str = "", timeout: float = DEFAULT_TIMEOUT_SECONDS) -> str | None:
    """None when `address` answers SERVING for `service`, else why not (one line)."""
    what = f"service {service!r} at {address}" if service else address
    try:
        status = check(address, service, timeout)
    except grpc.RpcError as error:
        code = error.code() if isinstance(error, grpc.Call) else None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"no health service answered at {address} within {timeout:g} s"
        details = error.details() if isinstance(error, grpc.Call) else str(error)
        return f"{what}: {code.name if code else 'error'} {details or ''}".rstrip()
    return None if status == "SERVING" else f"{what} is {status}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m services.health_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("address", type=address_argument, help="HOST:PORT of the health port (--health-listen)")
    parser.add_argument("--service", default="", help='the service to ask about (default "": the process as a whole)')
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS, help="seconds to wait (default 3)")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout must be positive, got {args.timeout:g}")
    why = problem(args.address, args.service, args.timeout)
    if why is not None:
        print(f"health_probe: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
