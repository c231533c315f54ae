"""kombu's filesystem transport, made safe for several processes (no side effects on import).

kombu 5.7's filesystem transport has two races between processes, both of which crash a worker
with ``JSONDecodeError`` out of ``drain_events``:

- ``Channel._put`` creates a message file under its final name and only then writes it, so a
  consumer in another process can move and read it while it is still empty;
- ``Channel._queue_bind`` creates an exchange table with ``open("wb")`` *before* locking it, so
  another process binding or publishing at the same moment can lock and read an empty table.

Here a message is written to a hidden file that consumers ignore (its name does not contain the
``.<queue>.msg`` that kombu's ``_get`` looks for) and renamed into place (atomic
within one file system), and exchange tables are created without truncation and read under the
lock, an empty table reading as "no bindings yet". Select it with
``broker_transport = "example_project.transport:FilesystemTransport"``.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from kombu.transport import filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads

__all__ = ["FilesystemTransport"]


class _SafeChannel(filesystem.Channel):
    """kombu's filesystem channel without its two cross-process races (see the module)."""

    def _put(  # type: ignore[override]  # same signature as filesystem.Channel._put
        self, queue: Any, payload: Any, **kwargs: Any
    ) -> None:
        unique = uuid.uuid4()
        final = os.path.join(
            self.data_folder_out, f"{round(time.monotonic() * 1000)}_{unique}.{queue}.msg"
        )
        # The temporary name must not contain ".<queue>.msg": kombu < 5.7 picks up any file
        # whose name contains it (a substring match), which would read this one half-written.
        partial = os.path.join(self.data_folder_out, f".{unique}.partial")
        with open(partial, "wb") as handle:
            handle.write(str(kombu_dumps(payload)).encode())  # type: ignore[no-untyped-call]
        os.replace(partial, final)

    def _table_file(self, exchange: Any) -> Any:
        """The exchange table's path (kombu >= 5.7 validates the name; older kombu does not)."""
        validated = getattr(super(), "_exchange_file", None)
        if validated is not None:
            return validated(exchange)
        return self.control_folder / f"{exchange}.exchange"

    def get_table(self, exchange: Any) -> list[Any]:
        file = self._table_file(exchange)
        try:
            with file.open("rb") as handle:
                filesystem.lock(handle, filesystem.LOCK_SH)
                try:
                    raw = handle.read()
                finally:
                    filesystem.unlock(handle)
        except FileNotFoundError:
            return []
        if not raw.strip():
            return []  # created by a binder that has not written it yet
        return [filesystem.exchange_queue_t(*q) for q in kombu_loads(bytes_to_str(raw))]

    def _queue_bind(self, exchange: Any, routing_key: Any, pattern: Any, queue: Any) -> None:
        file = self._table_file(exchange)
        self.control_folder.mkdir(exist_ok=True)
        wanted = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        # "a+b" creates the file if missing without truncating what another process wrote.
        with open(file, "a+b", buffering=0) as handle:
            filesystem.lock(handle, filesystem.LOCK_EX)
            try:
                handle.seek(0)
                raw = handle.read()
                table = kombu_loads(bytes_to_str(raw)) if raw.strip() else []
                queues = [filesystem.exchange_queue_t(*q) for q in table]
                if wanted not in queues:
                    queues.insert(0, wanted)
                    handle.seek(0)
                    handle.truncate()
                    handle.write(str_to_bytes(kombu_dumps(queues)))  # type: ignore[no-untyped-call]
            finally:
                filesystem.unlock(handle)


class FilesystemTransport(filesystem.Transport):  # type: ignore[misc]
    """kombu's filesystem transport with :class:`_SafeChannel` (``filesystem://`` URLs)."""

    Channel = _SafeChannel
