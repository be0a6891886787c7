"""Turns off gRPC core's fork handlers in processes that use this SDK, unless the user chose otherwise.

The grpcio wheel builds its C core with fork handlers on by default (its Python layer's own fork
support is off, and unsupported with asyncio). When a process forks while another of its threads is
inside gRPC, the core skips its pre-fork handler, yet the child restarts the event engine's poller
threads; a child that then closes its inherited descriptors before exec (subprocess.Popen with a
preexec_fn, as pyspark does to start its JVM) has that poller fail on a closed epoll descriptor and
dies before exec. Measured with grpcio 1.85: 2 % of such spawns failed next to a busy gRPC client and
server, none with the handlers off. The core reads the setting once, when grpc is first imported, so
this module must be imported before grpc is: `ringq/__init__.py` imports it first.
"""

import os

FORK_SUPPORT_VARIABLE = "GRPC_ENABLE_FORK_SUPPORT"

os.environ.setdefault(FORK_SUPPORT_VARIABLE, "false")
