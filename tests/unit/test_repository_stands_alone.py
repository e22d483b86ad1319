"""The repository stands on its own: no product code, doc, test or script names a path outside it.

A clone's parent folder holds nothing a user has. Code that read `../shared/traces` stopped `make
demo` on a clone by itself, and docs that pointed to `../shared/papers/*.txt` or to design notes
pointed readers at files they do not have. Papers are cited by title and section; data the product
needs ships inside it (kvfleet.sim.bundled).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Paths outside the repository, in the spellings they were written in.
OUTSIDE = re.compile(
    r"\.\./shared|shared/(papers|traces)|\"\.\.\" / \"shared\"|\"shared\" / \"(traces|papers)\"|parent / \"shared\""
    r"|FIELD-NOTES|DESIGN\.md|papers/[a-z-]+\.txt"
)
EXEMPT = {"tests/unit/test_repository_stands_alone.py"}
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".yaml", ".yml", ".json", ".sh", ".cfg", ".ini", ".tpl", ""}


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [name for name in out.splitlines() if Path(name).suffix in TEXT_SUFFIXES and name not in EXEMPT]


def test_no_tracked_file_names_a_path_outside_the_repository() -> None:
    files = tracked_files()
    assert len(files) > 100, "git ls-files found too little: is this a checkout?"
    hits = []
    for name in files:
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


def test_the_pattern_catches_each_spelling() -> None:
    for line in ('TRACES = ROOT / ".." / "shared" / "traces"', "see ../shared/papers/mell.txt §V",
                 'REPO_ROOT.parent / "shared" / "traces"', "as FIELD-NOTES says", "DESIGN.md, Layout",
                 "papers/infinite-llm-distattention.txt section 4.2"):
        assert OUTSIDE.search(line), line
    assert not OUTSIDE.search("MELL (Liu et al.), §VI, Fig. 10; a shared prefix")
