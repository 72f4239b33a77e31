"""Classification data for roformer-finetune: CLUE-style jsonl or GLUE-style tsv, single sentences or pairs.

jsonl: one JSON object per line, ``{"sentence": ..., "label": ...}`` (single) or ``{"sentence1": ...,
"sentence2": ..., "label": ...}`` (pair); other keys are ignored, blank lines skipped. tsv: a header row
naming the columns (``sentence`` and ``label``, or ``sentence1``, ``sentence2`` and ``label``), then one
example per line, fields separated by tabs (no quoting). Labels are strings or integers; the label set is
the training file's, sorted (numerically when every label is an integer or a string of digits).

Every problem is a :class:`~data_pipeline.errors.DataError` naming the file and line.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

from data_pipeline.corpus import MAX_LINE_BYTES, read_line
from data_pipeline.errors import DataError

__all__ = ["Example", "Dataset", "read_examples", "label_list", "encode_labels", "numbered_lines", "json_line", "jsonl_objects"]

Label = Union[str, int]
_SINGLE, _PAIR = ("sentence",), ("sentence1", "sentence2")


@dataclass
class Example:
    text_a: str
    text_b: Optional[str]
    label: Label
    line: int
    """1-based line number in the file (for messages)."""


@dataclass
class Dataset:
    path: Path
    task: str
    """single | pair"""
    examples: list[Example]

    def __len__(self) -> int:
        return len(self.examples)


def _task_of(keys, where: str) -> str:
    if all(k in keys for k in _PAIR):
        return "pair"
    if "sentence" in keys:
        return "single"
    raise DataError(f"{where}: expected a field 'sentence' (single sentences) or 'sentence1' and "
                    f"'sentence2' (sentence pairs), found {sorted(keys)}")


def _label(value, where: str) -> Label:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise DataError(f"{where}: field 'label' must be a string or an integer, got {json.dumps(value)}")
    return value


def _text(value, key: str, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def numbered_lines(f, path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of binary file ``f``; a line over ``MAX_LINE_BYTES`` (one example per line:
    no real one is that long) is a DataError naming it, and is never read whole."""
    lineno = 0
    while True:
        raw, size = read_line(f, MAX_LINE_BYTES)
        if not size:
            return
        lineno += 1
        if raw is None:
            raise DataError(f"{path}:{lineno}: a line of {size} bytes, over the limit of {MAX_LINE_BYTES} bytes "
                            "for one example")
        yield lineno, raw


def json_line(raw: bytes, where: str) -> Optional[dict]:
    """The JSON object of one line of a jsonl file (None for a blank line); DataError naming ``where``."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: invalid UTF-8 ({e.reason} at byte {e.start})") from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # nested too deeply, an integer of too many digits
        raise DataError(f"{where}: invalid JSON ({'nested too deeply' if isinstance(e, RecursionError) else e})") \
            from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def jsonl_objects(path: Path) -> Iterator[tuple[int, str, dict]]:
    """(line number, "path:line", object) of each non-blank line of a jsonl file."""
    with open(path, "rb") as f:
        for lineno, raw in numbered_lines(f, path):
            where = f"{path}:{lineno}"
            obj = json_line(raw, where)
            if obj is not None:
                yield lineno, where, obj


def _read_jsonl(path: Path) -> tuple[str, list[Example]]:
    task, out = None, []
    for lineno, where, obj in jsonl_objects(path):
        t = _task_of(obj, where)
        if task is None:
            task = t
        elif t != task:
            raise DataError(f"{where}: a {t} example in a file of {task} examples (line "
                            f"{out[0].line} was {task})")
        if "label" not in obj:
            raise DataError(f"{where}: missing field 'label'")
        a = _text(obj[_PAIR[0] if task == "pair" else "sentence"],
                  _PAIR[0] if task == "pair" else "sentence", where)
        b = _text(obj[_PAIR[1]], _PAIR[1], where) if task == "pair" else None
        out.append(Example(a, b, _label(obj["label"], where), lineno))
    return task or "single", out


def _read_tsv(path: Path) -> tuple[str, list[Example]]:
    out: list[Example] = []
    header = None
    with open(path, "rb") as f:
        for lineno, raw in numbered_lines(f, path):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: invalid UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            fields = line.split("\t")
            if header is None:
                header = [h.strip() for h in fields]
                task = _task_of(header, f"{where} (the header row)")
                if "label" not in header:
                    raise DataError(f"{where} (the header row): missing column 'label' (columns: {header})")
                cols = [header.index(k) for k in (_PAIR if task == "pair" else _SINGLE)]
                label_col = header.index("label")
                continue
            if len(fields) != len(header):
                raise DataError(f"{where}: {len(fields)} tab-separated fields, the header has {len(header)} "
                                f"({header})")
            a = fields[cols[0]]
            b = fields[cols[1]] if task == "pair" else None
            label = fields[label_col].strip()
            if not label:
                raise DataError(f"{where}: empty 'label'")
            out.append(Example(a, b, label, lineno))
    if header is None:
        return "single", out
    return task, out


def read_examples(path: str | os.PathLike) -> Dataset:
    """Read a jsonl or tsv file (``.tsv`` is tsv, anything else jsonl)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    tsv = path.suffix.lower() == ".tsv"
    task, examples = (_read_tsv if tsv else _read_jsonl)(path)
    if not examples:
        raise DataError(f"{path}: no examples (the file is empty{' or has only a header' if tsv else ''})")
    return Dataset(path, task, examples)


def _sort_key(labels: list[Label]):
    if all(isinstance(x, int) for x in labels):
        return lambda x: (0, x, "")
    if all(isinstance(x, str) and re.fullmatch(r"-?[0-9]+", x) for x in labels):  # not str.isdigit: '²' is a digit
        return lambda x: (0, int(x), x)
    return lambda x: (1, 0, str(x))


def label_list(train: Dataset, dev: Dataset) -> list[Label]:
    """The training labels, sorted; DataError naming the first dev line whose label is not among them."""
    if train.task != dev.task:
        raise DataError(f"{dev.path}: {dev.task} examples, but {train.path} has {train.task} examples")
    labels = sorted({e.label for e in train.examples}, key=_sort_key(list({e.label for e in train.examples})))
    if len(labels) < 2:
        raise DataError(f"{train.path}: every example has the label {labels[0]!r}; a classifier needs at least "
                        "two labels")
    known = set(labels)
    for e in dev.examples:
        if e.label not in known:
            raise DataError(f"{dev.path}:{e.line}: label {e.label!r} does not occur in {train.path} "
                            f"(its labels: {', '.join(map(repr, labels[:20]))}{', ...' if len(labels) > 20 else ''})")
    return labels


def encode_labels(ds: Dataset, labels: list[Label]) -> list[int]:
    index = {x: i for i, x in enumerate(labels)}
    return [index[e.label] for e in ds.examples]
