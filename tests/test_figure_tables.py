"""Every table of measured figures in README.md and docs/guides names when, at which commit and on which machine
it was measured (docs/guides/contributing.md, "Documentation", says the same).

A table of figures is a Markdown table with at least ``MIN_DECIMALS`` decimal numbers. It is stamped either by
a caption on the line after it,

    *Measured 2026-12-03 at f8a1c78; 2 cores, torch 2.13.0 CPU build (CPU model not recorded).*

or, where its rows were measured apart, by a ``measured`` column whose every cell starts ``YYYY-MM-DD, HASH``
(the page or section states the machine and torch once, above the table). A table computed on paper says so
in the line that leads into it ("nothing here is measured"). In a git checkout every commit named must exist
and be no later than the day it names (where the whole history is there).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MIN_DECIMALS = 5
CAPTION = re.compile(r"^\*Measured (?P<day>\d{4}-\d{2}-\d{2}) at (?P<commit>[0-9a-f]{7,40})\b[^*]*\b(?P<cores>\d+ cores)"
                     r"[^*]*\btorch \d+\.\d+[^*]*\*$")
CELL = re.compile(r"^(?P<day>\d{4}-\d{2}-\d{2}), (?P<commit>[0-9a-f]{7,40})\b")
ON_PAPER = "nothing here is measured"


@dataclass(frozen=True)
class Table:
    file: str
    line: int           # the header's line, 1-based
    rows: list[str]     # header, separator and body lines
    lead: str           # the last non-empty line before the table
    after: str          # the first non-empty line after it

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def tables(path: Path, root: Path = ROOT) -> list[Table]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i, fence = [], 0, False
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            fence = not fence
        if not fence and lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|\s*:?-{3}", lines[i + 1]):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            lead = next((x for x in reversed(lines[:i]) if x.strip()), "")
            after = next((x for x in lines[j:] if x.strip()), "")
            out.append(Table(str(path.relative_to(root)), i + 1, lines[i:j], lead, after))
            i = j
        else:
            i += 1
    return out


def figure_tables(root: Path = ROOT) -> list[Table]:
    files = [root / "README.md", *sorted((root / "docs" / "guides").glob("*.md"))]
    return [t for f in files for t in tables(f, root) if len(re.findall(r"\d+\.\d+", "\n".join(t.rows[2:]))) >= MIN_DECIMALS]


def cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split(" | ")]


def stamps(t: Table) -> list[tuple[str, str]]:
    """The (day, commit) pairs a table names: its caption's, or each row's ``measured`` cell; [] where it has
    neither (or a column with a cell that names no day and commit)."""
    m = CAPTION.match(t.after.strip())
    if m:
        return [(m["day"], m["commit"])]
    header = cells(t.rows[0])
    if "measured" in header:
        k = header.index("measured")
        found = [CELL.match(cells(r)[k]) for r in t.rows[2:]]
        if all(found):
            return [(f["day"], f["commit"]) for f in found]
    return []


def commit_day(commit: str) -> date | None:
    """The commit's author day (UTC), or None when git does not know it."""
    r = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%at", f"{commit}^{{commit}}", "--"],
                       capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        return None
    return datetime.fromtimestamp(int(r.stdout), tz=timezone.utc).date()


def full_git_history() -> bool:
    """A git checkout with its whole history (a shallow clone lacks the older commits)."""
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip() == "false"


def test_every_table_of_figures_names_its_day_commit_and_machine():
    found = figure_tables()
    assert len(found) >= 20, f"only {len(found)} tables of figures found: the detection is broken"
    unstamped = [t.where for t in found if ON_PAPER not in t.lead and not stamps(t)]
    assert not unstamped, ("tables of figures without a '*Measured DAY at COMMIT; ... N cores, torch X.Y ...*' "
                           f"caption or a 'measured' column: {unstamped}")


@pytest.mark.skipif(not full_git_history(), reason="no git history here (not a checkout, or a shallow clone)")
def test_the_commits_the_tables_name_exist_and_precede_their_day():
    bad = []
    for t in figure_tables():
        for day, commit in stamps(t):
            when = commit_day(commit)
            if when is None:
                bad.append(f"{t.where}: {commit} is not a commit of this repository")
            elif when > date.fromisoformat(day):
                bad.append(f"{t.where}: {commit} is from {when}, after the day named, {day}")
    assert not bad, "\n".join(bad)


def test_a_table_without_a_stamp_is_found(tmp_path):
    """The rule catches what it is for: a table of figures with no caption, and one whose caption has no
    machine, are reported; a caption or a measured column satisfies it."""
    (tmp_path / "docs" / "guides").mkdir(parents=True)
    body = "| a | b |\n| --- | --- |\n| 1.1 | 2.2 |\n| 3.3 | 4.4 |\n| 5.5 | 6.6 |\n"
    (tmp_path / "README.md").write_text("lead:\n\n" + body + "\n*Measured 2026-12-03 at abc1234.*\n")
    (tmp_path / "docs" / "guides" / "g.md").write_text(
        "lead:\n\n" + body + "\n*Measured 2026-12-03 at abc1234; 2 cores, torch 2.13.0 CPU build.*\n\n"
        "| x | measured |\n| --- | --- |\n| 1.5 | 2026-12-01, def5678 |\n| 2.5 | 2026-12-02, def5678 |\n"
        "| 3.5 | 2026-12-02, 0123abc |\n| 4.5 | 2026-12-02, def5678 |\n| 5.5 | x |\n")
    found = {t.where: stamps(t) for t in figure_tables(tmp_path)}
    assert found == {"README.md:3": [], "docs/guides/g.md:3": [("2026-12-03", "abc1234")],
                     "docs/guides/g.md:11": []}
