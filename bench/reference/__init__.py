"""The reference side of `make bench`: RabbitMQ 3.x classic mirrored queues, 3 nodes on loopback.

`python -m bench.reference [--quick] [--json PATH]` runs it alone; the ringq
side can call `run_reference()` and print `ReferenceReport.results` (one
`WorkloadResult` per workload) next to its own figures.
"""

from bench.reference.rabbitmq_cluster import RabbitCluster, RabbitClusterError, rabbitmq_available
from bench.reference.rabbitmq_workloads import (
    Durations,
    ReferenceReport,
    WorkloadResult,
    format_table,
    run_reference,
    run_w1,
    run_w2,
    run_w3,
)

__all__ = [
    "Durations",
    "RabbitCluster",
    "RabbitClusterError",
    "ReferenceReport",
    "WorkloadResult",
    "format_table",
    "rabbitmq_available",
    "run_reference",
    "run_w1",
    "run_w2",
    "run_w3",
]
