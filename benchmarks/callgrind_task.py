"""Instructions per task, counted by ``valgrind --tool=callgrind``: repeatable on a busy machine.

Each configuration runs ``python -m benchmarks.bench_task_overhead --only <contender> --count N``
(Celery's own tracer, in-process, no broker; the process passes for a solo worker's) under
callgrind twice, with ``--count 0`` and ``--count N``: the difference of the two totals over
``N`` is the instructions one task costs, start-up and warm-up cancelled out. The interpreter runs
with ``PYTHONHASHSEED=0`` so both runs hash alike.

Configurations (``--configs``, comma-separated): ``plain`` (null store), ``null`` (LockedTask on
a store whose calls do nothing: our Python alone), ``memory`` (LockedTask on a MemoryLockStore,
the throughput benchmark's ``LockedTask-memory``) and ``redis`` (LockedTask on a RedisLockStore
and a throwaway ``redis-server``, which runs outside valgrind: the worker-side instructions of
the store calls, waiting excluded); ``redis-early`` is ``redis`` with each task received first
as a solo worker receives it (``--early``: the acquire sent at receipt, its reply read by the
run), so it less ``redis`` is what the early acquire adds or saves per task. Each runs with the
result ignored (``off``) and stored (``on``, ``--results``).

``--annotate DIR`` keeps the callgrind files in ``DIR`` and prints, per task, the C functions
whose own (exclusive) instruction count grows most from ``plain`` to ``memory`` (what our Python
makes the interpreter do), and the top functions by inclusive cost of the ``memory`` run
(``callgrind_annotate --inclusive=yes``).

``--micro`` counts, the same way, single steps of the LockedTask hot path in a loop (the
statements of :data:`MICRO`, after the set-up of a traced LockedTask on a MemoryLockStore):
what each costs per call, to tell which of our steps the per-task total is made of.

Run: ``python -m benchmarks.callgrind_task [--count 1000] [--configs plain,null,memory,redis]
[--results off,on] [--jobs 2] [--annotate DIR] [--top 25] [--json PATH] [--micro [NAMES]]``;
about 75 s of one core per callgrind run here (most of it the interpreter's start-up under
valgrind).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {  # name -> (store, contender, more arguments of bench_task_overhead)
    "plain": ("null", "plain", ()),
    "null": ("null", "LockedTask", ()),
    "memory": ("memory", "LockedTask", ()),
    "redis": ("redis", "LockedTask", ()),
    "redis-early": ("redis", "LockedTask", ("--early",)),
}
# The set-up of --micro: a traced LockedTask on a MemoryLockStore, warmed up, as a solo worker's.
MICRO_SETUP = """
import uuid
from celery import Celery
from celery.signals import task_postrun, task_success
from benchmarks.bench_task_overhead import make_tracers
from celery_lease import LockedTask, MemoryLockStore, lease, signals
from celery_lease import _forking as forking
from celery_lease._celery import deferral, worker
from celery_lease._celery.settings import get_settings
from celery_lease._celery.store_resolution import execution_store
from celery_lease._core.lease import clock_of
from celery_lease._core.owners import make_owner
store = MemoryLockStore()
tracers = make_tracers(store)
for name in tracers:
    for i in range(200):
        tracers[name](i)
APP = Celery("micro", broker="memory://", set_as_current=False)
APP.conf.update(task_ignore_result=True, lease_store=store)
@APP.task(name="m.locked", base=LockedTask, lock_key="m:{i}", shared=False)
def locked(i):
    return None
TASK = APP.tasks["m.locked"]
SPEC = TASK._lock_get_spec()
TID = str(uuid.uuid4())
SETTINGS = get_settings(APP)
for _ in range(2):  # the first resolution builds the app's store: kept from the second
    SPEC.resolve(APP, SETTINGS, "m:0")
assert SPEC.kept(APP) is not None
from celery.app.task import Context
from celery_lease.clock import SYSTEM_CLOCK
from celery_lease._celery import execution
from celery_lease._core.lease import LeaseContext
REQ = Context(id=TID, delivery_info={"routing_key": "celery"}, hostname="bench@host")
REQ.is_eager = False
from celery.signals import task_prerun
from benchmarks.bench_task_overhead import NullStore
from celery_lease._core.held_key import HeldKey
NULL = NullStore()
def _noop(reason):
    pass
"""
# name -> statement run per loop pass (``_i``: the pass number); see ``--micro``.
MICRO = {
    "pass": "pass",
    "get_settings": "get_settings(APP)",
    "execution_store": "execution_store(None, APP, 'k')",
    "clock_of": "clock_of(store)",
    "make_owner": "make_owner(node='bench@host', task='o.locked', task_id=TID, ttl_ms=30000)",
    "uuid4": "str(uuid.uuid4())",
    "forking.generation": "forking.generation()",
    "only_ours x3": "deferral.only_ours(task_success); deferral.only_ours(task_postrun);"
    " deferral.only_ours(signals.lock_released)",
    "running_task": "worker.running_task()",
    "closure": "(lambda: _i)",
    "publishes_nothing": "deferral.publishes_nothing(TASK, REQ)",
    "LeaseContext()": "LeaseContext('k', store, 30.0, 0.0, None, 0.0, None, None, SYSTEM_CLOCK,"
    " node='bench@host', task='m.locked', task_id=TID)",
    "_Run()": "execution._Run(TASK, REQ, 'k', SPEC.options)",
    "spec.durations": "SPEC.durations(SETTINGS)",
    "spec.kept": "SPEC.kept(APP)",
    "memory store acquire+release": "store.acquire(f'a{_i}', 'o', 30000);"
    " store.release(f'a{_i}', 'o')",
    "key_function": "SPEC.key_function((_i,), {})",
    "lease() cycle on memory store": "with lease(f'm{_i}', store=store): pass",
    "lease() cycle on a null store": "with lease(f'n{_i}', store=NULL): pass",
    "renewer add+remove (HeldKey start+stop)": "h = HeldKey(store=NULL, key='h', owner='o',"
    " ttl=30.0, sent_at=SYSTEM_CLOCK.monotonic(), max_hold_at=None, on_lost=_noop, token=1);"
    " h.start(SYSTEM_CLOCK); h.stop()",
    "Celery's prerun+postrun dispatch": "task_prerun.send(sender=TASK, task_id=TID, task=TASK,"
    " args=(), kwargs={}); task_postrun.send(sender=TASK, task_id=TID, task=TASK, args=(),"
    " kwargs={}, retval=None, state='SUCCESS')",
    "trace plain": "tracers['plain'](_i)",
    "trace LockedTask": "tracers['LockedTask'](_i + 10_000_000)",
}
_LINE = re.compile(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*?)(?:\s+\[[^\]]*\])?$")


def callgrind(
    out: Path, store: str, contender: str, count: int, results: bool, more: Iterable[str] = ()
) -> int:
    """Total instructions of one traced run; its callgrind file is ``out``."""
    return _callgrind(
        out,
        [
            "-m",
            "benchmarks.bench_task_overhead",
            "--store",
            store,
            "--only",
            contender,
            "--count",
            str(count),
            *(["--results"] if results else []),
            *more,
        ],
    )


def callgrind_micro(out: Path, statement: str, count: int) -> int:
    """Total instructions of :data:`MICRO_SETUP` and ``count`` passes of ``statement``."""
    return _callgrind(out, ["-c", f"{MICRO_SETUP}\nfor _i in range({count}):\n    {statement}\n"])


def _callgrind(out: Path, python_argv: list[str]) -> int:
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable]
    argv += python_argv
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(ROOT)}
    subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True)
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith("totals:") or line.startswith("summary:"):
            return int(line.split()[1])
    raise SystemExit(f"no totals in {out}")


def functions(out: Path, inclusive: bool = False) -> dict[str, int]:
    """``{file:function: Ir}`` from ``callgrind_annotate`` (exclusive, or inclusive)."""
    argv = ["callgrind_annotate", "--threshold=100"]
    if inclusive:
        argv.append("--inclusive=yes")
    text = subprocess.run([*argv, str(out)], check=True, capture_output=True, text=True).stdout
    costs: dict[str, int] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match and "PROGRAM TOTALS" not in line:
            name = re.sub(r"^/tmp/python-build[^ ]*?/Python-[\d.]+/", "", match.group(2))
            costs[name] = costs.get(name, 0) + int(match.group(1).replace(",", ""))
    return costs


def top(costs: dict[str, int], per: int, n: int) -> Iterable[tuple[str, float]]:
    for name, ir in sorted(costs.items(), key=lambda kv: -abs(kv[1]))[:n]:
        yield name, ir / per


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=1000, help="tasks in the counted run")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--results", default="off,on", help="off, on or both")
    parser.add_argument("--jobs", type=int, default=2, help="callgrind runs at once")
    parser.add_argument("--annotate", metavar="DIR", help="keep the callgrind files, annotate")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--micro",
        nargs="?",
        const=",".join(MICRO),
        metavar="NAMES",
        help="count single hot-path steps instead (comma-separated; default all: "
        + ", ".join(MICRO)
        + ")",
    )
    options = parser.parse_args(argv)
    if options.micro is not None:
        names = [n for n in options.micro.split(",") if n]
        unknown = [n for n in names if n not in MICRO]
        if unknown or not names:
            parser.error(f"--micro={options.micro!r}: use some of {', '.join(MICRO)}")
        if options.count < 1 or options.jobs < 1:
            parser.error(f"--count={options.count} --jobs={options.jobs}: both must be >= 1")
        run_micro(names, options.count, options.jobs, options.json)
        return
    configs = [c for c in options.configs.split(",") if c]
    modes = [m for m in options.results.split(",") if m]
    if not configs or any(c not in CONFIGS for c in configs):
        parser.error(f"--configs={options.configs!r}: use {', '.join(CONFIGS)}")
    if not modes or any(m not in ("off", "on") for m in modes):
        parser.error(f"--results={options.results!r}: use off, on or both")
    if options.count < 1 or options.jobs < 1:
        parser.error(f"--count={options.count} --jobs={options.jobs}: both must be >= 1")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on PATH (apt-get install valgrind)")
    folder = Path(options.annotate or tempfile.mkdtemp(prefix="callgrind-task-"))
    folder.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[str, str, int], Path] = {}
    for mode in modes:
        for config in configs:
            store, _, _ = CONFIGS[config]
            runs.setdefault((store, mode, 0), folder / f"base-{store}-{mode}.out")
            runs[(config, mode, options.count)] = folder / f"{config}-{mode}.out"

    def run(item: tuple[tuple[str, str, int], Path]) -> tuple[tuple[str, str, int], int]:
        (name, mode, count), out = item
        more: tuple[str, ...] = ()
        if count == 0:  # a baseline: the store's process with no counted task
            store, contender = name, "plain"
        else:
            store, contender, more = CONFIGS[name]
        return (name, mode, count), callgrind(out, store, contender, count, mode == "on", more)

    with ThreadPoolExecutor(options.jobs) as pool:
        totals = dict(pool.map(run, runs.items()))
    per_task: dict[str, dict[str, float]] = {}
    print(
        f"Instructions per task (callgrind, {options.count} tasks less 0;"
        f" Python {sys.version.split()[0]})\n"
    )
    print("| configuration | results | Ir/task | over plain |")
    print("|---|---|---:|---:|")
    for mode in modes:
        plain = None
        if "plain" in configs:
            plain = (
                totals[("plain", mode, options.count)] - totals[("null", mode, 0)]
            ) / options.count
        for config in configs:
            store, _, _ = CONFIGS[config]
            ir = (totals[(config, mode, options.count)] - totals[(store, mode, 0)]) / options.count
            per_task.setdefault(config, {})[mode] = ir
            over = "-" if plain is None else f"{ir - plain:,.0f}"
            print(f"| {config} | {mode} | {ir:,.0f} | {over} |")
    report: dict[str, object] = {"count": options.count, "ir_per_task": per_task}
    if options.annotate and "plain" in configs and "memory" in configs:
        mode = modes[0]
        plain_fns = functions(runs[("plain", mode, options.count)])
        memory_fns = functions(runs[("memory", mode, options.count)])
        base_plain = functions(runs[("null", mode, 0)])
        base_memory = functions(runs[("memory", mode, 0)])
        grown = {
            name: (memory_fns.get(name, 0) - base_memory.get(name, 0))
            - (plain_fns.get(name, 0) - base_plain.get(name, 0))
            for name in set(memory_fns) | set(plain_fns)
        }
        print(f"\nExclusive Ir per task, memory less plain (results {mode}), top {options.top}:\n")
        for name, ir in top(grown, options.count, options.top):
            print(f"{ir:10,.0f}  {name}")
        inclusive = functions(runs[("memory", mode, options.count)], inclusive=True)
        base_inclusive = functions(runs[("memory", mode, 0)], inclusive=True)
        counted = {n: ir - base_inclusive.get(n, 0) for n, ir in inclusive.items()}
        print(f"\nInclusive Ir per task, memory (results {mode}), top {options.top}:\n")
        for name, ir in top(counted, options.count, options.top):
            print(f"{ir:10,.0f}  {name}")
        report["grown_exclusive"] = dict(top(grown, options.count, options.top))
        report["memory_inclusive"] = dict(top(counted, options.count, options.top))
    if options.json:
        Path(options.json).write_text(json.dumps(report, indent=2) + "\n")
    if not options.annotate:
        shutil.rmtree(folder, ignore_errors=True)


def run_micro(names: list[str], count: int, jobs: int, json_path: str | None) -> None:
    """Print the instructions per pass of each :data:`MICRO` statement (see ``--micro``)."""
    folder = Path(tempfile.mkdtemp(prefix="callgrind-micro-"))
    items = [("", "pass", 0)] + [(n, MICRO[n], count) for n in names]

    def run(item: tuple[str, str, int]) -> tuple[str, int]:
        name, statement, n = item
        out = folder / f"micro-{items.index(item)}.out"
        return name, callgrind_micro(out, statement, n)

    try:
        with ThreadPoolExecutor(jobs) as pool:
            totals = dict(pool.map(run, items))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    base = totals[""]
    print(f"Instructions per call (callgrind, {count} passes less 0, loop included)\n")
    print("| step | Ir/call |")
    print("|---|---:|")
    per_call = {}
    for name in names:
        per_call[name] = (totals[name] - base) / count
        print(f"| {name} | {per_call[name]:,.0f} |")
    if json_path:
        Path(json_path).write_text(json.dumps({"count": count, "ir_per_call": per_call}) + "\n")


if __name__ == "__main__":
    main()
