"""``celery -A proj inspect leases``: each worker answers with the leases its processes hold now
(registered by :func:`~celery_lease._celery.wiring.install` and by :mod:`celery_lease.cli`: the
client checks names against its own registry). Under prefork each child serves its snapshot on
``<dir>/<pid>.sock`` (private, made before the fork); the main process asks all within
:data:`CHILD_TIMEOUT` and lists a silent child in ``unanswered``, never as holding nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import selectors
import shutil
import socket
import tempfile
import threading
import time
from typing import TypedDict, cast

from celery.worker.control import inspect_command

from celery_lease._celery import compat
from celery_lease._core import renewer
from celery_lease._core.owners import parse_owner
from celery_lease.stores.slots import split_slot

logger = logging.getLogger("celery_lease.control")

# Seconds the main process waits in all for its children (``inspect``'s own timeout is 1 s).
CHILD_TIMEOUT = 0.5
_MAX_REPLY = 16 * 1024 * 1024  # bytes: a child's snapshot larger than this is refused
_dir: str | None = None  # the socket directory (made in the main process, inherited)
_dir_pid: int | None = None  # the main process that made _dir (only it removes it)
_cleanup_registered = False  # cleanup_main runs at exit (registered once a process)
_server: socket.socket | None = None


class LeaseRow(TypedDict):
    """One held lease in the reply, from a :func:`~celery_lease._core.renewer.snapshot` row:
    ``key`` as asked for and ``slot``, its slot when it was taken with a limit (else ``None``)."""

    key: str | None
    slot: int | None
    token: int | None
    task: str | None
    task_id: str | None
    label: str | None
    node: str | None
    pid: int
    held_seconds: float | None
    valid_for_seconds: float | None
    renewals: int | None
    last_renewal_error: str | None
    owner: str | None


class Unanswered(TypedDict):
    """A pool child that did not answer, and why."""

    pid: int
    error: str


class LeasesReply(TypedDict):
    """A worker's answer to ``celery inspect leases``."""

    leases: list[LeaseRow]
    pool: str
    unanswered: list[Unanswered]


def prepare_main() -> None:
    """Before the pool forks: make the socket directory (removed at shutdown, or at exit)."""
    global _dir, _dir_pid, _cleanup_registered
    if _dir is not None and _dir_pid == os.getpid():
        return
    try:
        _dir = tempfile.mkdtemp(prefix=f"celery-lease-{os.getpid()}-")  # mode 0700
    except OSError as exc:  # raising here would skip the rest of worker_init (Celery swallows it)
        logger.warning(
            "celery-lease: cannot make the socket directory of `inspect leases` (%s): pool"
            " processes are listed as unanswered",
            exc,
        )
        _dir = None
        return
    _dir_pid = os.getpid()
    if not _cleanup_registered:
        atexit.register(cleanup_main)
        _cleanup_registered = True


def cleanup_main() -> None:
    global _dir, _dir_pid
    if _dir is not None and _dir_pid == os.getpid():
        shutil.rmtree(_dir, ignore_errors=True)
        _dir = _dir_pid = None


def socket_path(pid: int) -> str | None:
    """Where pool child ``pid`` serves, or None outside a prepared worker."""
    return None if _dir is None else os.path.join(_dir, f"{pid}.sock")


def forget_child(pid: int) -> None:
    """Remove the socket file of a gone child (a SIGKILLed child leaves it)."""
    path = socket_path(pid)
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


def local_rows() -> list[LeaseRow]:
    """This process's leases with pid and parsed owner."""
    rows: list[LeaseRow] = []
    pid = os.getpid()
    for row in renewer.snapshot():
        holder = parse_owner(str(row.get("owner", "")))
        store_key = row.get("key")
        key, slot = (None, None) if store_key is None else split_slot(str(store_key))
        rows.append(
            {
                "key": key,
                "slot": slot,
                "token": row.get("token"),
                "task": holder.task,
                "task_id": holder.task_id,
                "label": holder.label,
                "node": holder.node,
                "pid": pid,
                "held_seconds": row.get("held_seconds"),
                "valid_for_seconds": row.get("valid_for_seconds"),
                "renewals": row.get("renewals"),
                "last_renewal_error": row.get("last_renewal_error"),
                "owner": row.get("owner"),
            }
        )
    return rows


def serve_in_child() -> None:
    """In a new pool child of a prepared worker: serve :func:`local_rows` from a daemon thread."""
    global _server
    path = socket_path(os.getpid())
    if path is None:
        return
    if _server is not None:  # inherited from a parent that served (a fork of a fork)
        with contextlib.suppress(OSError):
            _server.close()
        _server = None
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale file of a dead process that had this pid
        server.bind(path)
        server.listen(8)
    except OSError as exc:
        server.close()
        logger.warning("celery-lease: `inspect leases` cannot reach this process (%s)", exc)
        return
    _server = server
    threading.Thread(
        target=_serve, args=(server,), name="celery-lease inspect", daemon=True
    ).start()


def _serve(server: socket.socket) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return  # closed
        try:
            with conn:
                conn.settimeout(CHILD_TIMEOUT)
                conn.sendall(json.dumps(local_rows(), default=str).encode())
        except Exception as exc:  # a reader that went away; never kill the thread
            logger.debug("celery-lease: inspect reply failed: %s", exc)


def child_snapshots(
    pids: list[int], timeout: float = CHILD_TIMEOUT
) -> tuple[list[LeaseRow], list[Unanswered]]:
    """Ask children ``pids`` at once, ``timeout`` s in all: ``(rows, unanswered)``."""
    rows: list[LeaseRow] = []
    unanswered: list[Unanswered] = []
    deadline = time.monotonic() + timeout
    pending: dict[socket.socket, tuple[int, bytearray]] = {}
    with selectors.DefaultSelector() as selector:
        for pid in pids:
            sock, why = _connect(pid)
            if sock is None:
                unanswered.append({"pid": pid, "error": why})
                continue
            pending[sock] = (pid, bytearray())
            selector.register(sock, selectors.EVENT_READ)
        while pending and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                sock = cast(socket.socket, key.fileobj)
                pid, buffer = pending[sock]
                done, error = _read_more(sock, buffer)
                if not done:
                    continue
                selector.unregister(sock)
                sock.close()
                del pending[sock]
                if error is None:
                    answer, error = _parse(buffer)
                    if answer is not None:
                        rows.extend(answer)
                        continue
                unanswered.append({"pid": pid, "error": error})
        for sock, (pid, _) in pending.items():
            sock.close()
            unanswered.append({"pid": pid, "error": f"no answer within {timeout:g} s"})
    return rows, unanswered


def _connect(pid: int) -> tuple[socket.socket | None, str]:
    path = socket_path(pid)
    if path is None:
        return None, "no socket directory in this worker"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect(path)  # a unix socket connects at once or fails at once
    except OSError as exc:
        sock.close()
        return None, f"cannot connect: {exc}"
    return sock, ""


def _read_more(sock: socket.socket, buffer: bytearray) -> tuple[bool, str | None]:
    """Read what ``sock`` has into ``buffer``: ``(done, error)``."""
    try:
        chunk = sock.recv(65536)
    except BlockingIOError:
        return False, None
    except OSError as exc:
        return True, f"read failed: {exc}"
    if not chunk:
        return True, None
    if len(buffer) + len(chunk) > _MAX_REPLY:
        return True, f"reply larger than {_MAX_REPLY} bytes"
    buffer.extend(chunk)
    return False, None


def _parse(buffer: bytearray) -> tuple[list[LeaseRow] | None, str]:
    try:
        answer = json.loads(bytes(buffer))
    except ValueError as exc:
        return None, f"bad reply: {exc}"
    if isinstance(answer, list) and all(isinstance(r, dict) for r in answer):
        return answer, ""
    return None, f"bad reply: not a list of lease rows ({type(answer).__name__})"


def leases(state: object, **kwargs: object) -> LeasesReply:
    """List the leases held by this worker's processes now."""
    pool = getattr(getattr(state, "consumer", None), "pool", None)
    module = type(pool).__module__ if pool is not None else ""
    rows = local_rows()
    unanswered: list[Unanswered] = []
    processes = compat.child_processes(compat.billiard_pool(pool)) or []  # None: in-process
    children = [pid for p in processes if (pid := getattr(p, "pid", None))]
    if children:
        child_rows, unanswered = child_snapshots(children)
        rows.extend(child_rows)
    rows.sort(key=_order)
    return {
        "leases": rows,
        "pool": module.rsplit(".", 1)[-1] if module.startswith("celery.") else module,
        "unanswered": unanswered,
    }


def _order(row: LeaseRow) -> tuple[str, int, int]:
    """Rows by key, then slot (a key's own lease before its slots), then pid."""
    slot = row.get("slot")
    return str(row.get("key")), -1 if slot is None else int(slot), int(row.get("pid") or 0)


def register_command() -> None:
    """Register :func:`leases` as the remote-control command ``leases`` (idempotent)."""
    inspect_command(default_timeout=1.0)(leases)
