"""The Spark lifecycle job: per-message lifecycle, stage latencies, throughput, failover window and the
delivery guarantees (lost, duplicates, order) from ringq client histories and span files.

Modules, one job each: `inputs` (file discovery, explicit schemas, reading JSON lines), `tables`
(the messages, stages, throughput and failover_buckets tables), `guarantees` (the violations
table), `failover` (fault windows and gaps), `summary` (the result as values, and its console
text), `report` (report.md and the charts), `lifecycle` (`run_lifecycle`: the job end to end) and
`__main__` (the CLI). Importing this package imports pyspark and matplotlib but starts nothing.
"""

from pipeline.inputs import InputError
from pipeline.lifecycle import run_lifecycle, spark_session
from pipeline.summary import FailoverWindow, FaultBuckets, Gap, StageLatency, Summary, Violation

__all__ = [
    "FailoverWindow",
    "FaultBuckets",
    "Gap",
    "InputError",
    "StageLatency",
    "Summary",
    "Violation",
    "run_lifecycle",
    "spark_session",
]
