"""Misspelled settings: configured keys meant as ours that Celery never reads (it keeps unknown
keys silently, so ``lease_stor`` would quietly select another store)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from celery_lease.errors import LeaseConfigError

if TYPE_CHECKING:
    from celery_lease._celery.protocols import AppConf

_HINT_CUTOFF = 0.6  # difflib ratio from which a setting is offered as "did you mean"
_LOOKALIKE_CUTOFF = 0.8  # difflib ratio from which a key Celery would not read is our typo


def _cased(name: str, prefix: str) -> str:
    """``prefix + name`` in the case of the prefix, as Celery's ``Settings`` looks it up."""
    spelled = prefix + name
    return spelled.upper() if prefix.isupper() else spelled.lower()


def _spellings(name: str, prefix: str) -> tuple[str, ...]:
    """The keys under which ``app.conf`` finds ``name`` (as ``ConfigurationView._to_keys``)."""
    return (_cased(name, prefix), name) if prefix else (name,)


def _closest(name: str, settings: Sequence[str]) -> str | None:
    """The setting ``name`` most likely abbreviates or misspells, if any is close."""
    tail = name.removeprefix("lease_")
    for setting in settings:
        if tail and tail != name and setting.endswith("_" + tail):
            return setting  # lease_ttl -> lease_default_ttl, lease_prefix -> lease_key_prefix
    matches = difflib.get_close_matches(name, settings, n=1, cutoff=_HINT_CUTOFF)
    return matches[0] if matches else None


def _one_edit_apart(a: str, b: str) -> bool:
    """Whether one insertion, deletion, substitution or neighbour swap turns ``a`` into ``b``."""
    if a == b:
        return True
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        if len(diff) == 1:
            return True
        i = diff[0]
        return len(diff) == 2 and diff[1] == i + 1 and a[i] == b[i + 1] and a[i + 1] == b[i]
    short, long = (a, b) if len(a) < len(b) else (b, a)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


_WORD = re.compile(r"[a-z]+")


def _says_lease(name: str, settings: Sequence[str]) -> bool:
    """Whether ``name`` starts with ``lease`` (or one slip from it) or runs ours together."""
    first = _WORD.match(name)
    if first is not None and _one_edit_apart(first.group(), "lease"):
        return True
    squashed = re.sub(r"[^a-z]", "", name)
    squashed_settings = [setting.replace("_", "") for setting in settings]
    return squashed.startswith("lease") and bool(
        difflib.get_close_matches(squashed, squashed_settings, n=1, cutoff=_LOOKALIKE_CUTOFF)
    )


def misspelled_settings(conf: AppConf | Mapping[str, object], settings: Sequence[str]) -> list[str]:
    """One message per configured key of ``conf`` meant as one of ``settings`` but never read:
    a known name in a spelling Celery does not read, or a key that says ``lease`` and is close
    to one. Other libraries' names are never reported."""
    finalize = getattr(conf, "finalize", None)
    if callable(finalize):
        finalize()  # a pending app.conf: load config_from_object (and its namespace) first
    prefix = getattr(conf, "prefix", None) or ""
    readable = {key for name in settings for key in _spellings(name, prefix)}
    problems: list[str] = []
    without_defaults = getattr(conf, "without_defaults", None)  # app.conf: the user's keys only
    for key in list((without_defaults() if callable(without_defaults) else conf).keys()):
        if not isinstance(key, str) or key in readable:
            continue
        name = key.lower()
        for strip in (prefix.lower(), "celery_"):
            if strip and name.startswith(strip):
                name = name[len(strip) :]
                break
        in_namespace = bool(prefix) and key.startswith(_cased("", prefix))
        spelled_for_celery = key.islower() or in_namespace
        prefixed = bool(prefix) and not key.islower()
        if name in settings:
            reads = " or ".join(repr(s) for s in _spellings(name, prefix))
            note = ""
            if not prefix and not key.islower():
                note = (
                    " (names are case-sensitive; upper-case CELERY_LEASE_* names need"
                    " config_from_object(..., namespace='CELERY'))"
                )
            problems.append(f"{key!r} is never read by Celery: this app reads {reads}{note}")
            continue
        if not _says_lease(name, settings):
            continue
        lookalike = difflib.get_close_matches(name, settings, n=1, cutoff=_LOOKALIKE_CUTOFF)
        if not (lookalike or spelled_for_celery):
            continue
        meant = _closest(name, settings)
        hint = ""
        if meant is not None:
            spelled = _cased(meant, prefix) if prefixed else meant
            hint = f" (did you mean {spelled!r}?)"
        problems.append(f"{key!r} is not a celery-lease setting{hint}")
    return problems


def check_names(conf: AppConf | Mapping[str, object], settings: Sequence[str]) -> None:
    """Raise ``LeaseConfigError`` naming every key :func:`misspelled_settings` reports."""
    problems = misspelled_settings(conf, settings)
    if problems:
        prefix = getattr(conf, "prefix", None) or ""
        known = ", ".join(_cased(s, prefix) if prefix else s for s in settings)
        where = f" (namespace {prefix.rstrip('_')!r})" if prefix else ""
        raise LeaseConfigError(
            f"celery-lease: {'; '.join(problems)}. Celery ignores keys it does not know, so"
            " each would be ignored silently (a misspelled lease_store makes tasks use another"
            " lock store, the broker's Redis or a host-local SQLite file, that does not exclude"
            f" what the intended one would). The settings{where} are: {known}"
        )
