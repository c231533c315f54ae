"""Redis Cluster batches: a store's many calls fanned out to the nodes owning their slots.

redis-py refuses EVALSHA in cluster pipelines, so :class:`ClusterFanOut` pipelines a batch's calls
per node, every node at once (:class:`NodeWorkers`), refreshing a slot table a failover left stale
(:class:`SlotRefresh`); docs/internals.md (A Redis Cluster batch across nodes) says how.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import Any, TypeVar, cast

import redis
import redis.cluster
from redis.exceptions import AskError, ClusterDownError, RedisError, SlotNotCoveredError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_lease.stores._redis_common import RETRIED, SOCKET_TIMEOUT, Script, text
from celery_lease.stores._redis_compat import request_slot_refresh, run_requested_slot_refresh

logger = logging.getLogger("celery_lease.stores.redis")

_T = TypeVar("_T")

Calls = Sequence[tuple[Sequence[str], Sequence[str | int]]]  # Script calls: ``(keys, args)`` each.

# Replies (slots migrating; MovedError is an AskError) redone through the cluster client.
_REDIRECTED = (AskError, redis.exceptions.TryAgainError)
_NODE_THREAD = "celery-lease-redis-node"  # runs a batch's node share (numbered in the batch)
_SLOTS_THREAD = "celery-lease-redis-slots"  # refreshes a store's slot table after an error


def _start(target: Callable[[], None], name: str) -> threading.Thread | None:
    """``target`` on a daemon thread; None when run here instead (the interpreter exiting)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:
        target()
        return None
    return thread


class NodeWorkers:
    """Runs the nodes' shares of one cluster store's batch at once: the first in the calling
    thread, each other on a daemon thread started for the batch (at most one batch per ttl/3 and
    store): no pool to reset after a fork or shut down, and a share stuck on a hung node never
    holds up the interpreter's exit."""

    def run(
        self,
        jobs: Sequence[Callable[[], _T]],
        suspects: Collection[int] = (),
        late: Callable[[int], _T] | None = None,
    ) -> list[_T]:
        """Run every job at once; their results in order once all returned, or the first
        error in job order once all ended. The jobs at ``suspects`` (indices) are waited for
        only until the others ended (unless all are suspects): one still running goes on alone,
        its result or error dropped, ``late(index)`` in its place. The caller's thread runs a
        job that is no suspect."""
        patient = [index for index in range(len(jobs)) if index not in suspects]
        if not patient or late is None:
            patient, suspects = list(range(len(jobs))), ()
        results: list[_T | None] = [None] * len(jobs)
        errors: list[BaseException | None] = [None] * len(jobs)
        ended = [threading.Event() for _ in jobs]

        def share(index: int) -> None:
            try:
                results[index] = jobs[index]()
            except BaseException as exc:  # handed to the caller below
                errors[index] = exc
            finally:
                ended[index].set()

        order = patient + [index for index in range(len(jobs)) if index in suspects]
        threads = {
            index: _start(partial(share, index), f"{_NODE_THREAD}-{index}") for index in order[1:]
        }
        if jobs:
            share(order[0])
        for index in patient:
            thread = threads.get(index)
            if thread is not None:
                thread.join()
        answered: list[_T] = []
        for index in range(len(jobs)):
            if not ended[index].is_set():  # a suspect still running: not waited for
                assert late is not None
                answered.append(late(index))
                continue
            error = errors[index]
            if error is not None:
                raise error
            answered.append(cast("_T", results[index]))
        return answered


class SlotRefresh:
    """Runs a cluster store's slot-table refreshes on a daemon thread, one at a time per
    process: a batch waits only until its deadline, and a refresh stuck on a hung node holds up
    nobody. A refresh asked for while one runs joins it. Nothing to reset after a fork: a child
    sees its parent's refresh as not running (by process id) and starts its own."""

    def __init__(self, refresh: Callable[[], None]) -> None:
        self._refresh = refresh
        self._guard = threading.Lock()  # held for a few lines, never across the refresh
        self._running: tuple[int, threading.Event] | None = None

    def start(self) -> threading.Event:
        """Start a refresh unless one is running; the event set once the running one ended."""
        pid = os.getpid()
        with self._guard:
            running = self._running
            if running is not None and running[0] == pid and not running[1].is_set():
                return running[1]
            done = threading.Event()
            self._running = (pid, done)

        def run() -> None:
            try:
                self._refresh()
            finally:
                done.set()

        _start(run, _SLOTS_THREAD)
        return done


def before(deadline: float, job: Callable[[], _T]) -> tuple[bool, _T | None]:
    """Run ``job`` on a daemon thread of its own and wait for it until ``deadline``
    (``time.monotonic()``): ``(True, its result)``, or ``(False, None)`` when it had not ended
    then (it goes on alone; its result is dropped). A job that raises: raised here."""
    outcome: list[_T] = []
    error: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append(job())
        except BaseException as exc:  # handed to the caller below
            error.append(exc)
        finally:
            done.set()

    _start(run, _SLOTS_THREAD)
    if not done.wait(max(0.0, deadline - time.monotonic())):
        return False, None
    if error:
        raise error[0]
    return True, outcome[0]


def pipelined(
    client: redis.Redis,
    script: Script,
    calls: Calls,
    wait: tuple[int, int] | None = None,
    *,
    errors_in_place: bool = False,
) -> tuple[list[Any], int | None]:
    """EVALSHA each call in one pipeline; on NOSCRIPT load the script and redo the batch once.

    With ``wait`` (``(numreplicas, timeout ms)``) a ``WAIT`` ends the pipeline and the replicas
    that acknowledged are returned second (None without). Redirections are returned for the
    caller to redo; any other error reply is raised, or with ``errors_in_place`` returned.
    """
    for attempt in (1, 2):
        pipe = client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        if wait is not None:
            pipe.execute_command("WAIT", *wait)  # type: ignore[no-untyped-call]
        results: list[Any] = pipe.execute(raise_on_error=False)
        acks: Any = results.pop() if wait is not None else None
        if attempt == 1 and any(isinstance(r, redis.exceptions.NoScriptError) for r in results):
            client.script_load(script.source)
            continue
        for result in results:
            if isinstance(result, RETRIED) or (
                isinstance(result, Exception)
                and not errors_in_place
                and not isinstance(result, _REDIRECTED)
            ):
                raise result
        if isinstance(acks, Exception):
            raise acks
        return results, None if acks is None else int(acks)
    raise AssertionError("unreachable")  # pragma: no cover


# Results that may come from a slot table the cluster left behind: a refused or timed-out node,
# the cluster down (a failover under way), a slot the table names no node for.
_STALE_ROUTE = (*RETRIED, ClusterDownError, SlotNotCoveredError)


def _node_of(client: redis.cluster.RedisCluster, key: str) -> str | None:
    """The name of the node the client's slot table names for ``key`` (None: no node)."""
    try:
        node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
    except SlotNotCoveredError:
        return None
    return str(node.name)


class ClusterFanOut:
    """A cluster store's batches and key scans, every node at once, following the slot table.
    ``socket_timeout`` (None: :data:`SOCKET_TIMEOUT`) bounds a batch with its refresh and second
    try; ``eval_one`` (the store's single call) redoes the calls answered MOVED/ASK/TRYAGAIN."""

    def __init__(
        self,
        client: redis.cluster.RedisCluster,
        socket_timeout: float | None,
        eval_one: Callable[[Script, Sequence[str], Sequence[str | int]], Any],
        where: Callable[[], str],
        redact: Callable[[str], str],
    ) -> None:
        self._client = client
        self._timeout = socket_timeout or SOCKET_TIMEOUT
        self._eval_one = eval_one
        self._where = where
        self._redact = redact
        self._workers = NodeWorkers()
        self._slot_refresh = SlotRefresh(self._refresh_slots)
        # The nodes whose last share timed out, not answered since (names; a set's add and
        # discard are atomic, so no lock that a fork could leave held).
        self._timed_out: set[str] = set()

    def eval_many(self, script: Script, calls: Calls, *, every_node: bool = False) -> list[Any]:
        """Many EVALSHA, pipelined per node, all nodes at once; each call's reply, or in its
        place the exception its error reply stands for (docs/internals.md, A Redis Cluster batch
        across nodes). A hung or dead node's calls get its error in place, the others keep
        their replies: one socket timeout at most, refresh and second try of moved calls
        included; a call failing again or too late keeps its first error. A node whose last
        share timed out is waited for only until the others answered (alone, or with
        ``every_node`` as ``list`` wants, it is waited for)."""
        if not calls:
            return []
        client = self._client
        deadline = time.monotonic() + self._timeout
        results: list[Any] = [None] * len(calls)
        unanswered: set[int] | None = None if every_node else set()
        sent_to = self._send_by_node(script, calls, range(len(calls)), results, unanswered)
        stale = [i for i in sent_to if isinstance(results[i], _STALE_ROUTE)]
        if not stale:
            return results
        refreshed = self._slot_refresh.start()
        if unanswered is not None and all(i in unanswered for i in stale):
            return results  # the refresh goes on alone: the next batch follows it
        if not refreshed.wait(max(0.0, deadline - time.monotonic())):
            return results
        moved = [i for i in stale if _node_of(client, calls[i][0][0]) not in (None, sent_to[i])]
        if not moved:
            return results
        logger.info(
            "Redis store %s: the cluster's slot table changed; sending %d calls again "
            "to the nodes now serving their slots",
            self._where(),
            len(moved),
        )

        def resend() -> list[Any]:
            again: list[Any] = [None] * len(calls)
            self._send_by_node(script, calls, moved, again)
            return again

        ended, again = before(deadline, resend)
        if ended and again is not None:
            for index in moved:
                results[index] = again[index]
        return results

    def _refresh_slots(self) -> None:
        """Refresh the slot table after an error (the refresh requested, once due); whatever a
        refresh raises is logged and leaves the table in use. Run by :class:`SlotRefresh`."""
        try:
            run_requested_slot_refresh(self._client)
        except Exception as exc:  # redis-py 5 raises RedisClusterException, no RedisError
            logger.info(
                "Redis store %s: refreshing the cluster's slot table failed: %s",
                self._where(),
                self._redact(f"{type(exc).__name__}: {exc}"),
            )

    def _send_by_node(
        self,
        script: Script,
        calls: Calls,
        indices: Sequence[int],
        results: list[Any],
        unanswered: set[int] | None = None,
    ) -> dict[int, str | None]:
        """The calls at ``indices`` on their nodes at once, replies or errors into ``results``;
        each one's node (None: its slot has none). With ``unanswered``, a node whose last share
        timed out is not waited for: its calls get a timeout error, their indices go there."""
        client = self._client
        groups: dict[str, tuple[redis.Redis, list[int]]] = {}
        sent_to: dict[int, str | None] = {}
        for index in indices:
            try:
                node = client.get_node_from_key(calls[index][0][0])  # type: ignore[no-untyped-call]
            except SlotNotCoveredError as exc:
                request_slot_refresh(client)
                results[index] = exc
                sent_to[index] = None
                continue
            groups.setdefault(node.name, (client.get_redis_connection(node), []))[1].append(index)
            sent_to[index] = node.name
        jobs = [
            partial(self._node_share, name, node_client, script, [calls[i] for i in share])
            for name, (node_client, share) in groups.items()
        ]
        names = list(groups)
        timed_out = self._timed_out

        def late(job: int) -> list[Any]:
            error = RedisTimeoutError(
                f"node {names[job]} timed out before and did not answer by the time the other "
                "nodes of the batch had"
            )
            share = groups[names[job]][1]
            if unanswered is not None:
                unanswered.update(share)
            return [error] * len(share)

        suspects = {job for job, name in enumerate(names) if name in timed_out}
        replies = self._workers.run(jobs, suspects if unanswered is not None else (), late)
        for (_, share), answers in zip(groups.values(), replies, strict=True):
            for index, answer in zip(share, answers, strict=True):
                results[index] = answer
        return sent_to

    def _node_share(
        self, name: str, node_client: redis.Redis, script: Script, calls: Calls
    ) -> list[Any]:
        """One node's share of :meth:`eval_many` (redirections redone, errors in place)."""
        replies = self._node_pipeline(name, node_client, script, calls)
        for position, reply in enumerate(replies):
            if isinstance(reply, _REDIRECTED):
                try:
                    replies[position] = self._eval_one(script, *calls[position])
                except RedisError as exc:
                    replies[position] = exc
        if any(isinstance(reply, ClusterDownError) for reply in replies):
            request_slot_refresh(self._client)
        return replies

    def _node_pipeline(
        self, name: str, node_client: redis.Redis, script: Script, calls: Calls
    ) -> list[Any]:
        """The node's pipelined replies (errors in place), or that error once per call when the
        node times out (not asked again: a hung node would cost another socket timeout) or
        cannot be reached twice in a row; either asks for a refresh that queries it last."""
        try:
            try:
                replies = pipelined(node_client, script, calls, errors_in_place=True)[0]
            except RedisConnectionError as exc:
                self._log_retry(f"{len(calls)} calls on node {name}", exc)
                replies = pipelined(node_client, script, calls, errors_in_place=True)[0]
        except RETRIED as exc:
            if isinstance(exc, RedisTimeoutError):
                self._timed_out.add(name)
            request_slot_refresh(self._client, name)
            return [exc] * len(calls)
        self._timed_out.discard(name)
        return replies

    def _log_retry(self, what: str, exc: Exception) -> None:
        logger.info(
            "Redis store %s: retrying %s once after %s: %s",
            self._where(),
            what,
            type(exc).__name__,
            self._redact(str(exc)),
        )

    def _scan_node(
        self, name: str, node_client: redis.Redis, pattern: str
    ) -> list[str] | RedisError:
        """The keys matching ``pattern`` on one node, or the error that stopped the scan;
        retried once after a connection error (fast), never after a timeout. A node that fails
        asks for a slot-table refresh."""
        try:
            try:
                return [text(k) for k in node_client.scan_iter(match=pattern, count=1000)]
            except RedisConnectionError as exc:
                self._log_retry(f"the key scan of node {name}", exc)
            return [text(k) for k in node_client.scan_iter(match=pattern, count=1000)]
        except RETRIED as exc:
            request_slot_refresh(self._client, name)
            return exc
        except RedisError as exc:
            return exc

    def scan(self, pattern: str) -> set[str]:
        """The keys matching ``pattern`` on every master the slot table names, all at once.

        After refused connections only, and a slot-table refresh within one socket timeout, the
        masters not scanned yet are scanned; any other failure fails the scan (first error)."""
        client = self._client
        deadline = time.monotonic() + self._timeout
        found: set[str] = set()
        scanned: set[str] = set()
        for attempt in (1, 2):
            masters = [
                node
                for node in client.get_primaries()  # type: ignore[no-untyped-call]
                if node.name not in scanned
            ]
            jobs = [
                partial(self._scan_node, node.name, client.get_redis_connection(node), pattern)
                for node in masters
            ]
            failures: list[RedisError] = []
            for node, keys in zip(masters, self._workers.run(jobs), strict=True):
                if isinstance(keys, RedisError):
                    failures.append(keys)
                else:
                    scanned.add(node.name)
                    found.update(keys)
            if not failures:
                return found
            if attempt == 2:
                raise failures[0]
            refreshed = self._slot_refresh.start()
            if any(not isinstance(f, RedisConnectionError) for f in failures):
                raise failures[0]
            if not refreshed.wait(max(0.0, deadline - time.monotonic())):
                raise failures[0]
        raise AssertionError("unreachable")  # pragma: no cover
