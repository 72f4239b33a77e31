"""``jsonl``: one JSON object per line, the text in a string field (``text_field``, default ``text``).
``auto`` takes ``.jsonl`` and ``.json`` files (also ``.gz``) for it.

A line that is not JSON (also: nested too deeply for the parser, an integer of too many digits) is skipped and
counted (``strict``: a DataError naming the file and line); a blank line counts as an empty document. An
object without the field, or with a field that is not a string, is always a DataError naming the file and line.
"""

from __future__ import annotations

import json
from typing import Iterator

from ..errors import DataError
from ..lines import Lines
from .base import TEXT, ReadOptions

__all__ = ["JsonLines", "READER"]


class JsonLines:
    help = "one JSON object per line, the text in a field (--text-field), auto for .jsonl and .json files"
    suffixes = (".jsonl", ".json")
    kind = TEXT

    def looks_like(self, line: str) -> bool:
        return False

    def splittable(self, options: ReadOptions) -> bool:
        return True

    def records(self, lines: Lines, options: ReadOptions) -> Iterator[list[str]]:
        field, stats = options.text_field, lines.stats
        for at, line in lines.numbered():
            if not line.strip():
                stats.empty_docs += 1
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as e:       # also: nested too deeply, an integer of too many digits
                if options.strict:
                    why = e.msg if isinstance(e, json.JSONDecodeError) else \
                        "nested too deeply" if isinstance(e, RecursionError) else str(e)
                    raise DataError(f"{lines.where(at)}: invalid JSON ({why})") from None
                stats.invalid_json_lines += 1
                continue
            if not isinstance(obj, dict) or field not in obj:
                raise DataError(f"{lines.where(at)}: expected a JSON object with a string field {field!r} (set "
                                f"--text-field), got "
                                f"{'keys ' + str(sorted(obj)[:20]) if isinstance(obj, dict) else type(obj).__name__}")
            value = obj[field]
            if not isinstance(value, str):
                raise DataError(f"{lines.where(at)}: field {field!r} must be a string, got {type(value).__name__}")
            yield [value]


READER = JsonLines()
