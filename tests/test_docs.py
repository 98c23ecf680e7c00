"""The README and docs/ stay true: every relative link resolves, and each `--help` block in the docs
is what the command prints now.

A docs page marks a help block with `<!-- help: python -m MODULE --help -->` right above its code
fence. After changing a flag, rewrite the blocks with `.venv/bin/python tests/test_docs.py --write`.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HELP_BLOCK = re.compile(r"(<!-- help: (?P<cmd>[^>]+?) -->\n```\n)(?P<body>.*?)(```)", re.S)
# A fixed width, so the wrapped help text does not depend on the terminal.
COLUMNS = "110"


def _without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _without_code(text: str) -> str:
    """Prose only: a `[x](y)` inside inline code is an example, not a link."""
    return re.sub(r"`[^`\n]*`", "", _without_fences(text))


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    found, seen = set(), {}
    for line in _without_fences(page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links() -> list[str]:
    bad = []
    for page in PAGES:
        for m in re.finditer(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)", _without_code(page.read_text())):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):      # http:, mailto: ... are not ours to check
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and (dest.suffix != ".md" or fragment not in _anchors(dest)):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return bad


def help_text(cmd: str) -> str:
    argv = cmd.split()
    if argv[0] == "python":
        argv[0] = sys.executable
    env = {**os.environ, "COLUMNS": COLUMNS}
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout


def help_blocks() -> list[tuple[Path, str, str]]:
    """(page, command, the block's text) for every marked help block."""
    return [(page, m["cmd"], m["body"]) for page in PAGES for m in HELP_BLOCK.finditer(page.read_text())]


def test_links_resolve():
    assert PAGES[0].exists() and len(PAGES) > 1
    assert not broken_links(), broken_links()


def test_the_readme_is_a_front_page():
    assert len(PAGES[0].read_bytes()) < 8 * 1024


@pytest.mark.parametrize("page,cmd,body", help_blocks(), ids=[cmd for _, cmd, _ in help_blocks()])
def test_help_blocks_are_current(page, cmd, body):
    assert body == help_text(cmd), (f"{page.relative_to(ROOT)}: the `{cmd}` block is stale; "
                                    "rewrite it with .venv/bin/python tests/test_docs.py --write")


def write_help_blocks() -> None:
    for page in PAGES:
        text = page.read_text()
        new = HELP_BLOCK.sub(lambda m: m.group(1) + help_text(m["cmd"]) + m.group(4), text)
        if new != text:
            page.write_text(new)
            print(f"rewrote {page.relative_to(ROOT)}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: tests/test_docs.py --write   (rewrites the --help blocks in README.md and docs/)")
    write_help_blocks()
