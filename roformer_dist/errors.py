"""Error classes and exit statuses of roformer-dist's commands.

Each class is an error that is ours to explain and carries its exit status (``exit_status``): every
command runs through :func:`run_command` (defined with the data pipeline's errors, the lowest layer),
which prints its message on one line (no traceback) and exits with its status. An OS error that only
a write can cause (ENOSPC, EDQUOT, EROFS) is reported the same way with status 74. Any other
exception is a bug and shows its traceback (exit status 1).

    ConfigError      2   a config key, a flag or a combination is invalid (named in the message)
    DataError        4   corpus / shard set / tokenizer missing, damaged or inconsistent
    CheckpointError  5   no usable checkpoint, or one that does not match the model or layout
    RunLockedError   6   another run holds the run directory (the message names the holder)
    EnvironmentSetupError
                     7   this machine cannot build or load what the run needs (a DeepSpeed op: no compiler,
                         no nvcc, a TORCH_CUDA_ARCH_LIST it cannot read); the message names the op, the
                         variables and the fix
    StorageError    74   the run directory cannot be written (disk full, read-only, permission denied);
                         the message names the path and the OS error

Other statuses of ``roformer-train``: 0 done, 1 a bug (traceback), 3 too many consecutive non-finite
losses (the last good state was saved), 75 stopped by a signal after saving a complete checkpoint
(run again to continue; SLURM scripts requeue on it), 130 aborted by a second Ctrl-C (no checkpoint
written; the newest complete one stays ``latest``).
"""

from __future__ import annotations

import errno as _errno

from data_pipeline.errors import EXIT_INTERRUPTED, EXIT_STORAGE, DataError, exit_status, run_command

__all__ = ["ConfigError", "DataError", "CheckpointError", "RunLockedError", "EnvironmentSetupError", "StorageError",
           "EXIT_DONE", "EXIT_BUG", "EXIT_CONFIG", "EXIT_NONFINITE", "EXIT_DATA", "EXIT_CHECKPOINT", "EXIT_LOCKED",
           "EXIT_ENVIRONMENT", "EXIT_STORAGE", "EXIT_REQUEUE", "EXIT_HANG", "EXIT_ABORTED", "EXIT_STATUS_HELP", "exit_status",
           "run_command"]

EXIT_DONE = 0
EXIT_BUG = 1  # an unexpected exception: its traceback is shown
EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_DATA = 4
EXIT_CHECKPOINT = 5
EXIT_LOCKED = 6
EXIT_ENVIRONMENT = 7
EXIT_REQUEUE = 75  # EX_TEMPFAIL: saved because of a stop signal; run again to continue
EXIT_HANG = 76  # a rank made no progress for dist.hang_timeout_s: the launch was ended; run again to resume
EXIT_ABORTED = EXIT_INTERRUPTED  # 128 + SIGINT: a second Ctrl-C

EXIT_STATUS_HELP = """exit status:
  0    done
  1    unexpected error (a bug: the traceback is shown)
  2    bad config (the key is named)
  3    too many consecutive non-finite losses (the last good state was saved)
  4    data error: shard set, tokenizer (the file is named)
  5    checkpoint error: damaged, or written for another model or layout
  6    run_dir in use by another run (the holder is named)
  7    this machine cannot build what the run needs: a DeepSpeed op (the op, the variables and the fix are named)
  74   run_dir not writable: disk full, read-only, permission denied (the path is named)
  75   stopped by a signal after saving a complete checkpoint: run again to continue
  76   a rank made no progress for dist.hang_timeout_s (hung, or waiting for a hung peer): the launch was
       ended, the report is <run_dir>/hang/report.txt; run again to resume from the newest checkpoint
  130  aborted by a second Ctrl-C (nothing saved; the newest complete checkpoint stays latest)"""
"""For ``--help`` epilogs."""


class ConfigError(ValueError):
    """An invalid config key, value or combination; the message names the key."""

    exit_status = EXIT_CONFIG


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing or damaged files, another model or layout)."""

    exit_status = EXIT_CHECKPOINT


class RunLockedError(RuntimeError):
    """The run directory is held by another run; the message names the holder."""

    exit_status = EXIT_LOCKED


class EnvironmentSetupError(RuntimeError):
    """This machine cannot build or load something the run needs (a DeepSpeed op: no C++ compiler, no nvcc,
    a ``TORCH_CUDA_ARCH_LIST`` DeepSpeed cannot read); the message names it, the environment variables
    involved and the fix. Not a bug of ours: no traceback."""

    exit_status = EXIT_ENVIRONMENT


class StorageError(OSError):
    """Writing to the run directory failed for a reason of the filesystem (ENOSPC, EROFS, EACCES...)."""

    exit_status = EXIT_STORAGE

    @classmethod
    def from_os_error(cls, error: OSError, doing: str) -> "StorageError":
        """``doing``: what was being written, e.g. 'saving checkpoint step_00000012'."""
        code = _errno.errorcode.get(error.errno, "") if error.errno else ""
        reason = error.strerror or str(error)
        where = f" {error.filename}" if error.filename else ""
        if getattr(error, "filename2", None):
            where += f" -> {error.filename2}"
        msg = f"{doing}: cannot write{where}: {reason}" + (f" ({code})" if code else "")
        out = cls(msg)
        out.errno = error.errno  # the original cause stays inspectable
        out.filename = error.filename
        return out

    def with_note(self, note: str) -> "StorageError":
        """The same error with ``note`` appended to its message (e.g. what ``latest`` still names)."""
        out = StorageError(f"{self}; {note}")
        out.errno, out.filename = self.errno, self.filename
        return out

    def __str__(self) -> str:
        return self.args[0] if self.args else super().__str__()
