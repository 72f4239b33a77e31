"""Error classes and exit statuses of roformer-dist's commands.

Each class is an error that is ours to explain: the commands print its message (no traceback) and
exit with its status. Any other exception is a bug and shows its traceback.

    ConfigError      2   a config key, a flag or a combination is invalid (named in the message)
    DataError        4   corpus / shard set / tokenizer missing, damaged or inconsistent
    CheckpointError  5   no usable checkpoint, or one that does not match the model or layout

Other statuses of ``roformer-train``: 0 done, 3 too many consecutive non-finite losses,
75 stopped by a signal after saving a complete checkpoint (run again to continue).
"""

from __future__ import annotations

from data_pipeline.errors import DataError

__all__ = ["ConfigError", "DataError", "CheckpointError", "EXIT_DONE", "EXIT_CONFIG", "EXIT_NONFINITE",
           "EXIT_DATA", "EXIT_CHECKPOINT", "EXIT_REQUEUE", "exit_status"]

EXIT_DONE = 0
EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_DATA = 4
EXIT_CHECKPOINT = 5
EXIT_REQUEUE = 75  # EX_TEMPFAIL: saved because of a stop signal; run again to continue


class ConfigError(ValueError):
    """An invalid config key, value or combination; the message names the key."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing or damaged files, another model or layout)."""


def exit_status(error: BaseException) -> int | None:
    """The exit status for one of our errors, None for anything else (a bug: show the traceback)."""
    if isinstance(error, ConfigError):
        return EXIT_CONFIG
    if isinstance(error, DataError):
        return EXIT_DATA
    if isinstance(error, CheckpointError):
        return EXIT_CHECKPOINT
    return None
