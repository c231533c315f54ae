"""``is_protocol``: a Protocol class itself, never a class that implements or subclasses one."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from celery_lease.stores._typing_compat import is_protocol
from celery_lease.stores.base import LockStore, SupportsInspection


class _Readable(Protocol):
    def read(self) -> str: ...


class _Implementation(_Readable):
    def read(self) -> str:
        return "x"


class _Plain:
    def read(self) -> str:
        return "x"


def test_protocol_classes_are_protocols() -> None:
    assert is_protocol(_Readable)
    assert is_protocol(LockStore)
    assert is_protocol(SupportsInspection)
    assert is_protocol(runtime_checkable(_Readable))


def test_implementations_and_plain_classes_are_not() -> None:
    assert not is_protocol(_Implementation)  # a subclass of a protocol that is not one itself
    assert not is_protocol(_Plain)
    assert not is_protocol(object)
