"""``celery_lease.signals``: the lock signals are Celery signals with fixed names, sent only
when someone listens, and a receiver that raises never breaks the sender."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from celery.utils.dispatch import Signal

from celery_lease import signals

SIGNALS = {
    "lock_acquired": signals.lock_acquired,
    "lock_rejected": signals.lock_rejected,
    "lock_lost": signals.lock_lost,
    "lock_released": signals.lock_released,
    "lock_duplicate": signals.lock_duplicate,
}


@pytest.fixture
def signal() -> Iterator[Signal]:
    """A signal of the test's own, so no receiver of the package is involved."""
    yield Signal(name="test_signal", providing_args={"key"})


class TestNames:
    @pytest.mark.parametrize("name", sorted(SIGNALS))
    def test_each_signal_is_named_as_its_attribute(self, name: str) -> None:
        """The name receivers and logs see is the attribute's name."""
        assert isinstance(SIGNALS[name], Signal) and SIGNALS[name].name == name


class TestSend:
    def test_receivers_get_the_sender_and_the_arguments(self, signal: Signal) -> None:
        """send() passes the sender and the named arguments on."""
        got: list[tuple[Any, dict[str, Any]]] = []

        def receiver(sender: Any, **named: Any) -> None:
            got.append((sender, {k: v for k, v in named.items() if k != "signal"}))

        signal.connect(receiver, weak=False)
        signals.send(signal, "task", key="k", task_id="i")
        assert got == [("task", {"key": "k", "task_id": "i"})]

    def test_nothing_happens_without_receivers(
        self, signal: Signal, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """No receiver: Signal.send is not even called (the hot path stays cheap)."""

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("send called without receivers")

        monkeypatch.setattr(signal, "send", refuse)
        signals.send(signal, "task", key="k")

    def test_a_raising_receiver_is_logged_not_raised(
        self, signal: Signal, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A receiver's error never reaches the sender, and the next receiver still runs."""
        ran: list[str] = []

        def broken(sender: Any, **named: Any) -> None:
            raise RuntimeError("receiver bug")

        def fine(sender: Any, **named: Any) -> None:
            ran.append(named["key"])

        signal.connect(broken, weak=False)
        signal.connect(fine, weak=False)
        with caplog.at_level(logging.ERROR):
            signals.send(signal, "task", key="k")
        assert ran == ["k"]
        assert any("receiver bug" in (r.exc_text or r.getMessage()) for r in caplog.records)
