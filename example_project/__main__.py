"""``python -m example_project demo [--redis URL]``: run :mod:`example_project.demo`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = "usage: python -m example_project demo [--redis URL]"


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``demo``; anything else prints the usage and returns 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        print("  demo    two workers and beat on an embedded broker: leases, fencing, hand-off")
        return 0 if args else 2
    if args[0] != "demo":
        print(f"{USAGE}\nunknown command {args[0]!r}", file=sys.stderr)
        return 2
    from example_project.demo import main as demo_main

    return demo_main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
