"""A process that uses the SDK can start a child with a preexec_fn (as pyspark starts its JVM) while its
gRPC threads are busy: ringq._fork_safety turns gRPC core's fork handlers off before grpc loads, and a
value the user set is kept. Without it, about 2 % of such spawns died before exec (JAVA_GATEWAY_EXITED
in CI's Spark tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from ringq._fork_safety import FORK_SUPPORT_VARIABLE

SPAWNS = 400

PROBE = textwrap.dedent(
    """
    import asyncio, signal, subprocess, sys, threading
    import ringq
    import grpc
    from grpc import aio

    def serve_and_call(started, stop):
        async def main():
            server = aio.server()
            echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("probe.P", {"Echo": echo}),))
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary("/probe.P/Echo")
                await call(b"x")
                started.set()
                while not stop.is_set():
                    await asyncio.gather(*(call(b"x") for _ in range(50)))
            await server.stop(None)
        asyncio.run(main())

    started, stop = threading.Event(), threading.Event()
    threading.Thread(target=serve_and_call, args=(started, stop), daemon=True).start()
    if not started.wait(30):
        sys.exit("the gRPC traffic never started")
    failed = 0
    for _ in range(int(sys.argv[1])):
        child = subprocess.run(
            ["/bin/echo", "ok"], capture_output=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
        failed += child.returncode != 0 or child.stdout != b"ok\\n"
    stop.set()
    import os
    print(failed, os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "unset"))
    """
)


def _probe(env: dict[str, str]) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(SPAWNS)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    failed, setting = done.stdout.split()
    return int(failed), setting


def test_children_started_with_a_preexec_fn_survive_busy_grpc_threads() -> None:
    env = {key: value for key, value in os.environ.items() if key != FORK_SUPPORT_VARIABLE}
    failed, setting = _probe(env)
    assert failed == 0, f"{failed} of {SPAWNS} children died before exec"
    assert setting == "false"


def test_a_value_the_user_set_is_kept() -> None:
    env = {**os.environ, FORK_SUPPORT_VARIABLE: "1"}
    done = subprocess.run(
        [sys.executable, "-c", f"import os, ringq; print(os.environ[{FORK_SUPPORT_VARIABLE!r}])"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.stdout.strip() == "1", done.stderr[-2000:]
