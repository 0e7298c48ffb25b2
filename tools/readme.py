"""README.md, made from docs/index.md (the docs' home page), its links pointed into docs/.

    python tools/readme.py           # rewrite README.md
    python tools/readme.py --check   # exit 1 if README.md is stale

One text for both: the repository's front page and the docs' home page cannot drift apart.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INDEX = REPO / "docs" / "index.md"
README = REPO / "README.md"
NOTICE = "<!-- Made from docs/index.md by tools/readme.py: edit that file, then run the tool. -->\n"


def render() -> str:
    """docs/index.md with every relative link to a page (`page.md`, `page.md#anchor`) made `docs/page.md...`."""
    text = INDEX.read_text()
    return NOTICE + re.sub(r"\]\((?![a-z]+:|#|/)([^)]+\.md(?:#[^)]*)?)\)", r"](docs/\1)", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is stale")
    args = parser.parse_args()
    if args.check:
        if README.read_text() != render():
            sys.exit("README.md is stale: run python tools/readme.py")
        return
    README.write_text(render())


if __name__ == "__main__":
    main()
