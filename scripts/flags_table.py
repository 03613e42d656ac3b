"""Write the flags-and-defaults table, generated from kvserve/config.py and kvserve/serving_config.py, into README.md between its markers.

    python3 scripts/flags_table.py           # rewrite the table
    python3 scripts/flags_table.py --check   # exit 1 if the README's table is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's kvserve, whatever is installed

from kvserve.config_args import flags_table  # noqa: E402

START = "<!-- flags-table:start -->"
END = "<!-- flags-table:end -->"


def with_table(text: str, table: str) -> str:
    """``text`` with everything between the markers replaced by ``table``."""
    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise SystemExit(f"README.md lacks the markers {START} ... {END}")
    return f"{head}{START}\n{table}{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the table is stale; write nothing")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = parser.parse_args()
    text = args.readme.read_text(encoding="utf-8")
    updated = with_table(text, flags_table())
    if args.check:
        if updated != text:
            print(f"{args.readme}: the flags table is stale; run python3 scripts/flags_table.py", file=sys.stderr)
            return 1
        return 0
    if updated != text:
        args.readme.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
