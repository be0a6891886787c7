"""`make bench-tracing`: what tracing costs when it is off, measured rather than assumed.

Runs ringq's W1 (confirmed publishes through a 3-node cluster, the method of
bench/ringq_workloads.py) alternately on this tree and on a baseline commit
from before the tracing hooks existed (a git worktree), in the same run, and
reports both rates and their ratio. Tracing is off on both sides (no OTLP
endpoint, no trace directory), so any difference is the cost of the hooks
themselves. Also times `tracing.enabled()` alone, the check every hook makes
first.

    python -m bench.tracing_cost [--baseline COMMIT] [--runs N] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

from bench.markdown import replace_marked
from ringq import tracing

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "b11bb54"  # the SDK and stream acks, before the tracing hooks (d1e9c8b)
MARK_BEGIN = "<!-- tracing-cost:begin -->"
MARK_END = "<!-- tracing-cost:end -->"
_W1 = """
import json
from bench.ringq_workloads import RingqCluster, run_w1
from bench.reference.rabbitmq_workloads import Durations
with RingqCluster() as rc:
    result = run_w1(rc, Durations())
print("W1-RESULT " + json.dumps({"rate": result.rate}))
"""


def _worktree(commit: str, directory: Path) -> Path:
    tree = directory / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True)
    protos = sorted(str(p.relative_to(tree / "protos")) for p in (tree / "protos").rglob("*.proto"))
    generated = tree / "clients" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iprotos",
            f"--python_out={generated}",
            f"--grpc_python_out={generated}",
            *[f"protos/{p}" for p in protos],
        ],
        cwd=tree,
        check=True,
    )
    (generated / "ringq" / "v1" / "__init__.py").touch()
    return tree


def _w1(tree: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "RINGQ_TRACE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "clients" / "python")])
    done = subprocess.run(
        [sys.executable, "-c", _W1], cwd=tree, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    for line in done.stdout.splitlines():
        if line.startswith("W1-RESULT "):
            return float(json.loads(line.removeprefix("W1-RESULT "))["rate"])
    raise RuntimeError(f"W1 in {tree} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tracing_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE, help=f"a commit without the tracing hooks (default {BASELINE})")
    parser.add_argument("--runs", type=int, default=3, help="W1 runs per side, alternating (default 3)")
    parser.add_argument("--write", type=Path, help="put the result into this Markdown file")
    args = parser.parse_args(argv)
    check_ns = min(timeit.repeat(tracing.enabled, number=1_000_000, repeat=5)) * 1000
    rates: dict[str, list[float]] = {"baseline": [], "head": []}
    with tempfile.TemporaryDirectory(prefix="ringq-tracing-cost-") as scratch:
        baseline = _worktree(args.baseline, Path(scratch))
        try:
            for run in range(args.runs):
                for side, tree in (("baseline", baseline), ("head", ROOT)):
                    rates[side].append(_w1(tree))
                    print(f"run {run + 1} {side:8}: W1 {rates[side][-1]:,.0f} confirmed msgs/s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)], check=False)
    base, head = statistics.median(rates["baseline"]), statistics.median(rates["head"])
    spread = max((max(r) - min(r)) / statistics.median(r) for r in rates.values())
    lines = [
        MARK_BEGIN,
        "## The cost of tracing when it is off",
        "",
        f"`{' '.join(['python -m bench.tracing_cost', *(argv if argv is not None else sys.argv[1:])])}`: "
        f"ringq W1 (confirmed msgs/s, 3 nodes, 256 B) on this tree with tracing off, against commit "
        f"`{args.baseline}` (before the tracing hooks), alternating, {args.runs} runs each.",
        "",
        "| side | W1 runs | median |",
        "|---|---|---:|",
        f"| baseline `{args.baseline}` | {', '.join(f'{r:,.0f}' for r in rates['baseline'])} | {base:,.0f} |",
        f"| this tree, tracing off | {', '.join(f'{r:,.0f}' for r in rates['head'])} | {head:,.0f} |",
        "",
        f"Ratio {head / base:.3f}; the run-to-run spread within a side is up to {spread:.0%}, so a difference "
        f"smaller than that is not measurable here. `tracing.enabled()`, the check each hook makes first, "
        f"takes {check_ns:.0f} ns; a node makes two per queue step on the master (a step carries up to a "
        f"publish batch) and one per report on a mirror, the SDK one per message.",
        MARK_END,
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        replace_marked(args.write, MARK_BEGIN, MARK_END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
