"""The argument parser of every command (``roformer-train``, ``roformer-data``, ...): :class:`CommandParser`.

An ``argparse.ArgumentParser`` that differs in two ways:

- Options and positionals (``key.sub=value`` overrides, checkpoints) come in any order:
  ``roformer-train --config demo.yaml run_dir=x --fork runs/demo model.rope_theta=40000`` parses as
  if ``--fork`` came last. Plain argparse ends a ``nargs="*"`` positional at the first option and then
  refuses the rest ("unrecognized arguments"). This is ``parse_intermixed_args``, done by ``parse_args``
  itself and by every subcommand's parser; a parser with subcommands (which ``parse_intermixed_args``
  refuses) parses its own options the ordinary way, and also takes them after the subcommand
  (``roformer-data prepare ... -v``). After ``--`` everything is a positional, as in plain argparse (an
  argument list holding ``--`` is parsed the ordinary way: Python 3.11's intermixed parsing drops it).
- ``--version`` prints ``<prog> <version>`` (:func:`version`) and exits 0; a subcommand's parser has none
  of its own (``roformer-data --version``).

Everything else (usage errors, exit status 2, ``--help``) is argparse's own.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["CommandParser", "DISTRIBUTION", "version"]

DISTRIBUTION = "roformer-dist"
"""The distribution whose version ``--version`` prints."""

_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def version() -> str:
    """The installed ``roformer-dist``'s version; in a checkout without installed metadata, the version in its
    pyproject.toml; ``unknown`` when neither is there."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        text = _PYPROJECT.read_text()
    except OSError:
        return "unknown"
    # the [project] table's `version = "..."` (tomllib is not in Python 3.10, which we still support)
    project = re.search(r'^\[project\]\s*$(.*?)(?=^\[)', text + "\n[", re.M | re.S)
    found = project and re.search(r'^version\s*=\s*"([^"]+)"', project.group(1), re.M)
    return found.group(1) if found else "unknown"


class CommandParser(argparse.ArgumentParser):
    """See the module docstring. ``add_version=False``: no ``--version`` (a subcommand's parser)."""

    def __init__(self, *args, add_version: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self._intermixing = False
        if add_version:
            self.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                              help="print the command's name and version and exit")

    @classmethod
    def from_parser(cls, parser: argparse.ArgumentParser) -> "CommandParser":
        """A CommandParser with the arguments, texts and settings of ``parser`` (one built elsewhere as a plain
        ``ArgumentParser``), plus ``--version``."""
        return cls(prog=parser.prog, usage=parser.usage, description=parser.description, epilog=parser.epilog,
                   parents=[parser], formatter_class=parser.formatter_class, prefix_chars=parser.prefix_chars,
                   fromfile_prefix_chars=parser.fromfile_prefix_chars, argument_default=parser.argument_default,
                   conflict_handler=parser.conflict_handler, add_help=False, allow_abbrev=parser.allow_abbrev,
                   exit_on_error=parser.exit_on_error)

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", functools.partial(type(self), add_version=False))
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args: Optional[Sequence[str]] = None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        if self._intermixing:  # a pass of parse_known_intermixed_args
            return super().parse_known_args(args, namespace)
        if self._subcommands() is not None:
            namespace, extras = super().parse_known_args(args, namespace)
            return self._own_options(extras, namespace) if extras else (namespace, extras)
        if not self._can_intermix() or "--" in args:
            return super().parse_known_args(args, namespace)
        return self.parse_known_intermixed_args(args, namespace)

    def parse_known_intermixed_args(self, args: Optional[Sequence[str]] = None, namespace=None):
        self._intermixing = True
        try:
            return super().parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False

    def _subcommands(self) -> Optional[argparse.Action]:
        return next((a for a in self._get_positional_actions() if a.nargs == argparse.PARSER), None)

    def _can_intermix(self) -> bool:
        """What ``parse_known_intermixed_args`` accepts (it raises TypeError otherwise)."""
        positionals = self._get_positional_actions()
        return (all(a.nargs not in (argparse.PARSER, argparse.REMAINDER) for a in positionals)
                and not any(a in positionals for g in self._mutually_exclusive_groups for a in g._group_actions))

    def _own_options(self, extras: list[str], namespace) -> tuple[argparse.Namespace, list[str]]:
        """Parse what the subcommand left (``extras``) against this parser's own options: those given after
        the subcommand. Its positionals (the subcommand) are switched off meanwhile, as the options pass of
        ``parse_known_intermixed_args`` switches them off."""
        positionals = self._get_positional_actions()
        saved = [(a.nargs, a.default, a.required) for a in positionals]
        for a in positionals:
            a.nargs, a.default, a.required = argparse.SUPPRESS, argparse.SUPPRESS, False
        try:
            return super().parse_known_args(extras, namespace)
        finally:
            for a, (nargs, default, required) in zip(positionals, saved):
                a.nargs, a.default, a.required = nargs, default, required
