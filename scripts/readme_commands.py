"""README's commands, one a line: the command lines (not comments) of its first ```bash
block. `.ci/run` runs them as written in a fresh virtual environment.

    python scripts/readme_commands.py [README.md]
"""

from __future__ import annotations

import sys
from pathlib import Path


def commands(text: str) -> list[str]:
    lines = text.splitlines()
    try:
        start = lines.index("```bash") + 1
        end = lines.index("```", start)
    except ValueError:
        raise SystemExit("README.md has no ```bash block of commands") from None
    return [ln.strip() for ln in lines[start:end] if ln.strip() and not ln.lstrip().startswith("#")]


if __name__ == "__main__":
    readme = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parents[1] / "README.md")
    print("\n".join(commands(readme.read_text())))
