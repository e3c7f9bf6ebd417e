"""Print the README's quick-start commands, one per line: the ```bash blocks of its
"## Quick start" section, in order. `.ci/run` runs exactly these, so the README and CI
cannot drift apart.

usage: python tools/readme_commands.py README.md
"""

from __future__ import annotations

import re
import sys


def quick_start_commands(text: str) -> list[str]:
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.S | re.M)
    if section is None:
        raise SystemExit("README has no '## Quick start' section")
    blocks = re.findall(r"^```bash\n(.*?)^```", section.group(1), re.S | re.M)
    return [" ".join(b.replace("\\\n", " ").split()) for b in blocks]


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        print("\n".join(quick_start_commands(f.read())))
