"""Print the README's two set-up commands, one per line: the first code block's first two lines,
without their comments. `.ci/run` runs exactly these, so CI cannot do a step the README does not say."""

from __future__ import annotations

import re
import sys
from pathlib import Path


def readme_commands(readme: Path) -> list[str]:
    text = readme.read_text(encoding="utf-8")
    m = re.search(r"```(?:bash|sh)?\n(.*?)```", text, re.S)
    if not m:
        raise SystemExit("README.md has no code block with the set-up commands")
    lines = [ln for ln in m.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    cmds = [re.sub(r"\s+#.*$", "", ln).strip() for ln in lines[:2]]
    if len(cmds) != 2:
        raise SystemExit("README.md's first code block must hold the two set-up commands")
    return cmds


if __name__ == "__main__":
    for c in readme_commands(Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")):
        print(c)
