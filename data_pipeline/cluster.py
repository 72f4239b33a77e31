"""Shard building split over N tasks (processes here, or a SLURM job array), then one merge.

``roformer-data prepare|shards --tasks N`` (the submission is ``launcher/prepare.py``'s):

1. The output is staged beside ``--out`` (``StagedDir``; it must be on a filesystem every node
   sees). ``prepare`` trains the tokenizer once, on a sample (:func:`sample_texts`: the first
   documents of every input file), into the staging directory, before any task starts.
2. :func:`plan` cuts the corpus into N tasks of about equal input bytes, keeping the corpus
   order: files in sorted order, each task a run of consecutive files; a plain (uncompressed,
   one-document-per-line) file larger than a task's share is cut into byte ranges at line
   boundaries (:class:`~data_pipeline.corpus.InputRange`). Compressed files and blank-line
   separated documents are never cut.
3. Each task (:func:`run_task`) writes its own shards into ``<staging>/tasks/task-NNNNN/``,
   starting by removing whatever an earlier attempt left there (a requeued or restarted task
   starts over), and writes ``result.json`` (its shard entries and counts) last, atomically: a
   task is done when that file exists. While it works it keeps ``progress.json`` up to date.
4. :func:`merge` checks that every task is done and agrees on the tokenizer, renames the shards
   into one sequence ``shard-000000.tar ...`` in task order (the content, and so the sha256, does
   not change), writes the one manifest, and only then is the staging directory swapped in.

The merged set holds the documents of the single-process build in the same order (document keys
count from 0 in each task's shards; they only name a block's .ids, .len and .wwm members).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from .atomic import atomic_write_bytes, atomic_write_text
from .corpus import CorpusStats, InputRange, detect_format, expand_inputs, read_documents, splittable
from .errors import DataError
from .formats import ReadOptions
from .imported import KINDS, SENTENCEPIECE
from .manifest import MANIFEST, parse_manifest
from .options import DataOptions
from .shards import write_manifest, write_shards
from .tokenizer import sha256_file

__all__ = ["Spec", "Task", "plan", "sample_texts", "copy_tokenizer", "run_task", "merge", "summary",
           "read_progress"]

@dataclass(frozen=True)
class Spec:
    """What every task needs to know (picklable: it travels to the tasks)."""
    inputs: tuple
    fmt: str = "auto"
    read: ReadOptions = ReadOptions()
    """How the inputs are read (a format's options, whole)."""
    jieba: bool = False
    workers: int = 1
    shard_size_mb: float = 64.0
    max_docs_per_shard: Optional[int] = None
    tokenizer_kind: str = SENTENCEPIECE
    """The kind of the tokenizer in the staging directory (:data:`~data_pipeline.imported.KINDS`)."""

    @classmethod
    def from_options(cls, o: DataOptions, tokenizer_kind: str = SENTENCEPIECE) -> "Spec":
        c, s = o.corpus, o.shards
        return cls(tuple(c.inputs), c.fmt, c.read, c.jieba, max(1, s.workers or 1), s.shard_size_mb,
                   s.max_docs_per_shard, tokenizer_kind)

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's file name in the staging directory (and in the merged set)."""
        return KINDS[self.tokenizer_kind]


@dataclass(frozen=True)
class Task:
    index: int
    units: tuple            # Path | InputRange, in corpus order
    num_bytes: int

    def describe(self) -> str:
        files = {str(u.path if isinstance(u, InputRange) else u) for u in self.units}
        return f"{len(files)} file(s) in {len(self.units)} piece(s), {self.num_bytes / 1e6:.1f} MB"


def plan(spec: Spec, num_tasks: int) -> list[Task]:
    """The corpus cut into at most ``num_tasks`` tasks of about equal input bytes (module docstring)."""
    files = expand_inputs(spec.inputs)
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    share = max(1, math.ceil(total / num_tasks))
    units: list[tuple[object, int]] = []
    for f, size in zip(files, sizes):
        fmt = detect_format(f) if spec.fmt == "auto" else spec.fmt
        if size > share and splittable(f, fmt, spec.read.doc_boundary):
            cuts = list(range(0, size, share)) + [size]
            units += [(InputRange(f, a, b), b - a) for a, b in zip(cuts, cuts[1:])]
        else:
            units.append((f, size))
    # consecutive units, cut where the running total passes k * total / num_tasks
    tasks: list[list] = [[]]
    done = 0
    bounds = [total * k / num_tasks for k in range(1, num_tasks)]
    for unit, size in units:
        if tasks[-1] and bounds and done >= bounds[0]:
            tasks.append([])
            while bounds and done >= bounds[0]:
                bounds.pop(0)
        tasks[-1].append((unit, size))
        done += size
    return [Task(i, tuple(u for u, _ in t), sum(s for _, s in t)) for i, t in enumerate(tasks)]


def sample_texts(spec: Spec, num_docs: int) -> tuple[CorpusStats, Iterator[str]]:
    """Up to ``num_docs`` normalised documents for tokenizer training: the first of every input file,
    the same number from each (the corpus is not read to the end)."""
    files = expand_inputs(spec.inputs)
    per_file = max(1, math.ceil(num_docs / len(files)))
    stats = CorpusStats()

    def texts():
        for f in files:
            for d in read_documents(f, spec.fmt, spec.read, stats, limit=per_file):
                yield d.text

    return stats, texts()


def copy_tokenizer(tokenizer, into: Path, kind: str = SENTENCEPIECE) -> Path:
    """Copy the tokenizer file into the staging directory under its kind's name."""
    dst = Path(into) / KINDS[kind]
    atomic_write_bytes(dst, Path(tokenizer).read_bytes())
    return dst


def _task_dir(staging: Path, index: int) -> Path:
    return Path(staging) / "tasks" / f"task-{index:05d}"


def read_progress(staging: Path, index: int) -> Optional[dict]:
    try:
        return json.loads((_task_dir(staging, index) / "progress.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None


def run_task(spec: Spec, task: Task, staging: str) -> dict:
    """Build one task's shards (see the module docstring); returns what ``result.json`` holds."""
    staging = Path(staging)
    out = _task_dir(staging, task.index)
    shutil.rmtree(out, ignore_errors=True)          # a requeued / restarted task starts over
    out.mkdir(parents=True)
    t0 = time.time()
    last = [0.0]

    def progress(docs, tokens, text_bytes, final=False):
        now = time.time()
        if final or now - last[0] >= 2.0:
            last[0] = now
            el = max(now - t0, 1e-9)
            state = {"task": task.index, "docs": docs, "tokens": tokens, "text_bytes": text_bytes, "seconds": el,
                     "done": final}
            atomic_write_text(out / "progress.json", json.dumps(state))
            print(f"{time.strftime('%H:%M:%S')} task {task.index}: {docs} docs, {tokens} tokens, "
                  f"{text_bytes / 1e6:.1f} MB of text, {text_bytes / el / 1e6:.2f} MB/s", flush=True)

    stats = CorpusStats()
    m = write_shards(list(task.units), staging / spec.tokenizer_name, out, workers=spec.workers,
                     shard_size_mb=spec.shard_size_mb, max_docs_per_shard=spec.max_docs_per_shard, fmt=spec.fmt,
                     read=spec.read, jieba=spec.jieba, progress=False, stats=stats, copy_tokenizer=False,
                     on_progress=progress, allow_empty=True, kind=spec.tokenizer_kind)
    progress(m["num_docs"], m["num_tokens"], m["text_bytes"], final=True)
    result = {"task": task.index, "manifest": {k: v for k, v in m.items() if not k.startswith("_")},
              "stats": stats.to_dict(), "seconds": time.time() - t0, "host": socket.gethostname(),
              "units": [str(u) for u in task.units]}
    atomic_write_text(out / "result.json", json.dumps(result))
    return result


def _read_result(staging: Path, t: Task) -> dict:
    """Task ``t``'s ``result.json``, checked like a manifest before anything in it is trusted: its shard names
    (``shard-NNNNNN.tar``: they are joined to the task's directory), counts, hashes and stats; DataError
    naming the file otherwise."""
    path = _task_dir(staging, t.index) / "result.json"
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        raise DataError(f"task {t.index} did not finish ({path} missing): the shard set is not complete") from None
    try:
        if not isinstance(r, dict) or r.get("task") != t.index:
            raise DataError(f"{path}: expected the result of task {t.index}, got "
                            f"{r.get('task') if isinstance(r, dict) else type(r).__name__!r}")
        m = r["manifest"]
        if not isinstance(m, dict) or not isinstance(m.get("shards"), list) or not isinstance(m.get("text_bytes"), int):
            raise DataError(f"{path}: field 'manifest': expected a task manifest with 'shards' and 'text_bytes'")
        if m["shards"]:        # the task's tokenizer path is the staging one (absolute): checked by sha256 below
            tok = m.get("tokenizer") if isinstance(m.get("tokenizer"), dict) else {}
            parse_manifest(json.dumps({**m, "tokenizer": {"path": None, "sha256": tok.get("sha256")}}),
                           f"{path}: field 'manifest'")
        if not isinstance(r.get("seconds"), (int, float)) or isinstance(r["seconds"], bool):
            raise DataError(f"{path}: field 'seconds': expected a number, got {r.get('seconds')!r}")
        r["_stats"] = CorpusStats.from_dict(r["stats"])
    except DataError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{path}: not a task result ({type(e).__name__}: {e})") from None
    return r


def merge(staging: Path, tasks: list[Task]) -> dict:
    """One manifest over the tasks' shards (module docstring); DataError naming a task that is not done."""
    staging = Path(staging)
    results = [_read_result(staging, t) for t in tasks]
    entries: list[dict] = []
    stats = CorpusStats()
    text_bytes = 0
    firsts = [r["manifest"] for r in results if r["manifest"]["shards"]]
    if not firsts:
        raise DataError(f"no documents to write: every task found its input empty or invalid "
                        f"({sum(r['_stats'].lines for r in results)} lines read)")
    ref = firsts[0]
    kind = ref["tokenizer"].get("kind", SENTENCEPIECE)
    sha = sha256_file(staging / KINDS[kind])
    for t, r in zip(tasks, results):
        m = r["manifest"]
        stats.add_counts(r.pop("_stats"))
        text_bytes += m["text_bytes"]
        if m["shards"] and (m["tokenizer"]["sha256"] != sha or m["vocab_size"] != ref["vocab_size"]):
            raise DataError(f"task {t.index} was made with another tokenizer (sha256 "
                            f"{str(m['tokenizer']['sha256'])[:16]}..., the set's is {sha[:16]}...)")
        for e in m["shards"]:
            src = _task_dir(staging, t.index) / e["name"]          # a shard-NNNNNN.tar name (_read_result)
            name = f"shard-{len(entries):06d}.tar"
            if not src.is_file():
                raise DataError(f"task {t.index}: {src} is listed in its result but missing")
            os.replace(src, staging / name)
            entries.append({**e, "name": name})
    manifest = {**{k: ref[k] for k in ("format", "vocab_size", "special_ids", "dtype", "wwm")},
                "tokenizer": {**ref["tokenizer"], "path": KINDS[kind], "sha256": sha},
                "num_docs": sum(e["num_docs"] for e in entries), "num_tokens": sum(e["num_tokens"] for e in entries),
                "shards": entries, "jieba": ref.get("jieba", False), "text_bytes": text_bytes,
                "word_marks": ref.get("word_marks"), "tasks": len(tasks)}
    parse_manifest(json.dumps(manifest), staging / MANIFEST)   # what inspect and the loader will check
    write_manifest(staging, manifest)
    shutil.rmtree(staging / "tasks")
    shutil.rmtree(staging / "logs", ignore_errors=True)   # the submitter's task logs: all went well
    manifest["_stats"] = stats
    manifest["_results"] = results
    return manifest


def summary(m: dict, wall_s: float, out) -> str:
    """The overall line: docs, tokens, MB/s (of the whole run and per task)."""
    results = m["_results"]
    rates = sorted(r["manifest"]["text_bytes"] / max(r["seconds"], 1e-9) / 1e6 for r in results)
    mb = m["text_bytes"] / 1e6
    return (f"prepared {out}: {len(results)} task(s), {len(m['shards'])} shards, {m['num_docs']} documents, "
            f"{m['num_tokens']} tokens, {mb:.1f} MB of text in {wall_s:.1f} s ({mb / max(wall_s, 1e-9):.2f} MB/s "
            f"overall; per task {rates[0]:.2f} / {rates[len(rates) // 2]:.2f} / {rates[-1]:.2f} MB/s min / median "
            f"/ max)\ncorpus: {m['_stats'].summary()}")
