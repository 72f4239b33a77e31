"""``roformer-finetune``: the command's entry point; the command itself is :mod:`roformer_dist.finetune.run`.

Exit status: 0 done, 2 bad flags (ConfigError), 4 bad input files (DataError), 5 model or checkpoint
missing or unreadable (CheckpointError), 74 the output cannot be written (disk full, read-only).
"""

from __future__ import annotations

import sys
from typing import Optional

from data_pipeline.command_line import CommandParser
from roformer_dist.errors import run_command


def main(argv: Optional[list[str]] = None) -> int:
    from roformer_dist.finetune.run import build_parser, run  # torch and transformers: not needed to import this module

    # the library's parser as a command's: --version, usage errors and --help here; run() parses argv again
    CommandParser.from_parser(build_parser()).parse_args(argv)

    def body() -> int:
        run(argv)
        return 0

    return run_command("roformer-finetune", body)


if __name__ == "__main__":
    sys.exit(main())
