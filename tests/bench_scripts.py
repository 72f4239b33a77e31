"""A bench script (bench/NAME.py) imported as a module by a test, for its pure parts."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

BENCH = Path(__file__).resolve().parent.parent / "bench"


@contextlib.contextmanager
def bench_module(name: str) -> Iterator[ModuleType]:
    """``bench/<name>.py`` as the module ``bench_<name>``, with bench/ on sys.path meanwhile (its ``import
    _common``)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
