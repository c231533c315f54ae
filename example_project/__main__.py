"""``python -m example_project demo [--redis URL]``: run :mod:`example_project.demo`.

``python -m example_project --help`` (or ``-h``, or no argument) prints the demo's own options,
from the demo's argument parser (:func:`example_project.demo.build_parser`), so they cannot
drift apart. Runs from a clone of celery-lease only: ``example_project`` is not in the wheel.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = "usage: python -m example_project demo [--redis URL]"


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``demo``; anything else prints the usage and returns 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        from example_project.demo import build_parser

        print(USAGE)
        print("  demo    two workers and beat on an embedded broker: leases, fencing, hand-off\n")
        print(build_parser().format_help(), end="")
        return 0 if args else 2
    if args[0] != "demo":
        print(f"{USAGE}\nunknown command {args[0]!r}", file=sys.stderr)
        return 2
    from example_project.demo import main as demo_main

    return demo_main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
