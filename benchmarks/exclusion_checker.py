"""Mutual-exclusion checker: K holders x M acquisitions of hot keys on a store, then a verdict.

Reuses ``tests/faults/harness.py`` (run from the repository root)::

    python benchmarks/exclusion_checker.py sqlite:////tmp/leases.db
    python benchmarks/exclusion_checker.py redis://127.0.0.1:6390/0 --holders 6 --rounds 30
    python benchmarks/exclusion_checker.py memory:// --pause-prob 0.1
    python benchmarks/exclusion_checker.py postgresql://postgres@127.0.0.1/scratch
    python benchmarks/exclusion_checker.py redis://127.0.0.1:6390/0 --limit 3 --holders 6

With ``--limit N`` (N > 1) every holder takes one of the key's N slots (``lease(key, limit=N)``)
and the verdict counts the holders of a key that believed they held it at once: its peak must
not exceed N (the line ends ``peak holders per key: hot-a 3 of 3, ...``); each slot is fenced
as its own resource.

Processes for every store but ``memory://`` (threads). Pauses are real ``SIGSTOP`` of a holder
for ``--pause-for`` seconds (simulated for threads). The fenced resource is an SQLite file in a
temporary directory unless ``--fence`` names one. Prints
``<store>: N acquisitions, 0 overlaps, 0 stale writes accepted (...)``; exits 1 on a violation
(with ``--limit``, also when a key's peak is above the limit).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from celery_lease.stores.memory import MemoryLockStore
from tests.faults.harness import (
    FencedResource,
    Plan,
    check,
    run_processes,
    run_threads,
)


def main(argv: list[str] | None = None) -> int:
    """Run the checker; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "store", help="a store URL (memory://, sqlite:///, redis://, postgresql://)"
    )
    parser.add_argument("--holders", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12, help="acquisitions per holder")
    parser.add_argument("--keys", default="hot-a,hot-b")
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--hold-max", type=float, default=0.03)
    parser.add_argument("--pause-prob", type=float, default=0.06)
    parser.add_argument("--pause-for", type=float, default=None, help="default: 1.3 x ttl")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument(
        "--limit", type=int, default=1, help="holders of a key at once (> 1: slots); default 1"
    )
    parser.add_argument("--fence", help="fenced resource: sqlite:////path.db or a postgresql DSN")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the lease warnings")
    args = parser.parse_args(argv)
    if not args.verbose:  # every pause logs renewal failures and a loss: expected here
        logging.getLogger("celery_lease").setLevel(logging.ERROR)
    plan = Plan(
        keys=args.keys.split(","),
        rounds=args.rounds,
        seed=args.seed,
        ttl=args.ttl,
        wait=max(20.0, args.ttl * 10),
        hold_max=args.hold_max,
        pause_prob=args.pause_prob,
        pause_for=args.pause_for if args.pause_for is not None else args.ttl * 1.3,
        limit=args.limit,
    )
    with tempfile.TemporaryDirectory() as tmp:
        fence = args.fence or f"sqlite:///{Path(tmp) / 'fence.db'}"
        if args.store.startswith("memory://"):
            records = run_threads(
                MemoryLockStore(), FencedResource(fence), holders=args.holders, plan=plan
            )
        else:
            records = run_processes(args.store, fence, holders=args.holders, plan=plan)
        resource = FencedResource(fence)
        report = check(args.store.split("://")[0], records, resource.log(), limit=args.limit)
        resource.close()
    print(report.summary())
    for violation in report.violations:
        print("  VIOLATION:", violation)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
