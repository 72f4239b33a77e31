"""Where a shard set lives: a local directory or a URL prefix, read whole, bounded and with retries.

A *location* is either a directory or a URL: ``http://`` / ``https://`` (curl), ``pipe:COMMAND``
(the command's stdout, run by ``/bin/sh``), ``file:``, or another scheme webdataset's opener
(:func:`webdataset.gopen.gopen`) registers. A file of the set is found by appending ``/<name>``
to the location, or, when the location contains ``{name}``, by putting the name there
(``pipe:aws s3 cp s3://bucket/set/{name} -``).

Names from data (a manifest's shard names and ``tokenizer.path``, ...) are untrusted. Every name
given to :meth:`ShardSource.child` / :meth:`ShardSource.read` must be a plain base name
(:func:`check_name`: not empty, not ``.`` or ``..``, no ``/`` or ``\\``, no control character, not
starting with ``-``, valid UTF-8 of at most 255 bytes), else a :class:`DataError`. What goes into a
URL is escaped for it: into a ``pipe:`` command the name is shell-quoted (:func:`shlex.quote`), so
``{name}`` must stand *unquoted* in the command (``pipe:cat /data/{name}``, not ``'/data/{name}'``:
a ``{name}`` inside quotes is refused with a :class:`UsageError`); into an http(s) URL it is
percent-encoded.

Every read is bounded. It returns at most ``limit`` bytes (the caller's: the manifest's size of a
shard, a cap for a manifest or a tokenizer); a file or stream with more is a
:class:`TooLargeError` as soon as byte ``limit + 1`` arrives (the reading process is killed), so an
endless stream (``/dev/zero``) cannot fill the memory. Local files must be regular files (a
device, FIFO or socket is a :class:`DataError`, checked before opening). One read of a URL may take
at most ``RetryPolicy.timeout_s`` seconds (default 600): curl gets ``--max-time`` and
``--max-filesize``, a ``pipe:`` command (its whole process group) is killed; a stalled read is a
transient :class:`UrlError`.

Reading a URL: transient failures (HTTP 5xx/408/429, connection errors and time-outs, a
``pipe:`` command that fails, an I/O error) are retried ``RetryPolicy.attempts`` times in all,
waiting ``wait_s``, then twice as long each time (at most ``max_wait_s``), each retry logged as
a warning; a permanent failure (HTTP 404 and the other 4xx, a missing ``file:``) is raised at
once. Either way the :class:`~data_pipeline.errors.DataError` names the URL. A file larger than
its limit is not retried.

Why http(s) does not go through ``gopen`` itself: webdataset runs ``curl -f -s --retry 30
--retry-delay 2``, which retries silently at a fixed 2 s for up to a minute and discards curl's
error text, so a 404 surfaces as "exit 22" without the status. We run ``curl -sS -f`` with no
retries of its own, read its error text, and do the bounded, logged back-off here. ``pipe:`` runs
in its own process group (so that a time-out ends all of it); the other schemes but ``file:`` use
``gopen``'s command and are read the same bounded way.
"""

from __future__ import annotations

import logging
import os
import re
import selectors
import shlex
import signal
import stat
import subprocess
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import DataError, UsageError

__all__ = ["RetryPolicy", "set_default_retry", "default_retry", "is_url", "ShardSource", "UrlError", "TooLargeError",
           "read_url", "read_local_file", "check_name", "DEFAULT_TIMEOUT_S", "MAX_READ_BYTES"]

log = logging.getLogger(__name__)

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")   # two letters at least: C:\ is a path

DEFAULT_TIMEOUT_S = 600.0
"""The longest one read of a URL may take (``RetryPolicy.timeout_s``)."""
MAX_READ_BYTES = 1 << 34
"""The default limit of one read (16 GiB): what a reader gets when its caller states none."""
MAX_NAME_BYTES = 255
"""The longest file name (NAME_MAX)."""
_CHUNK = 1 << 20


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    """Reads of one URL in all (1 = no retry)."""
    wait_s: float = 1.0
    """Wait before the first retry; doubled before each further one."""
    max_wait_s: float = 30.0
    """Upper bound of one wait."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """One read of a URL that has not finished after this many seconds is a (transient) failure."""


_default = RetryPolicy()


def set_default_retry(policy: RetryPolicy) -> None:
    """The policy of sources created without one (the trainer sets it from ``data.url_retries``)."""
    global _default
    if policy.attempts < 1 or policy.wait_s < 0 or not policy.timeout_s > 0:
        raise ValueError(f"retry policy: expected attempts >= 1, wait_s >= 0 and timeout_s > 0, got {policy}")
    _default = policy


def default_retry() -> RetryPolicy:
    return _default


def is_url(location: str | os.PathLike) -> bool:
    return isinstance(location, str) and _SCHEME.match(location) is not None


class UrlError(DataError):
    """A URL that could not be read; ``permanent`` when retrying cannot help (HTTP 404, ...)."""

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent


class TooLargeError(DataError):
    """A file or stream with more bytes than its reader's limit (``limit``); nothing past byte
    ``limit + 1`` was read."""

    def __init__(self, message: str, limit: int):
        super().__init__(message)
        self.limit = limit


# --------------------------------------------------------------------------- names from data


def name_problem(name) -> Optional[str]:
    """Why ``name`` is not a plain base name (see the module docstring), or None when it is."""
    if not isinstance(name, str):
        return f"not a string but {type(name).__name__}"
    if not name:
        return "empty"
    if name in (".", ".."):
        return "a directory, not a file"
    if "/" in name or "\\" in name:
        return "a path: it holds '/' or '\\'"
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in name):
        return "it holds a control character"
    if name.startswith("-"):
        return "it starts with '-' (a command would read it as an option)"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "not valid UTF-8 text"
    if size > MAX_NAME_BYTES:
        return f"longer than {MAX_NAME_BYTES} bytes"
    return None


def check_name(name, where: str) -> str:
    """``name`` when it is a plain base name; else a DataError ``<where>: expected a plain file name ...``."""
    problem = name_problem(name)
    if problem is not None:
        raise DataError(f"{where}: expected a plain file name (no '/', '..', control characters), got "
                        f"{name!r}: {problem}")
    return name


def _quoted_at(command: str, index: int) -> bool:
    """Whether position ``index`` of a shell command lies inside single or double quotes."""
    state, i = None, 0
    while i < index:
        c = command[i]
        if state == "'":
            state = None if c == "'" else state
        elif c == "\\":
            i += 1
        elif state == '"':
            state = None if c == '"' else state
        elif c in "'\"":
            state = c
        i += 1
    return state is not None


def _check_pipe_slots(location: str) -> None:
    at = location.find("{name}")
    while at >= 0:
        if _quoted_at(location, at):
            raise UsageError(f"{location}: {{name}} stands inside quotes; write it unquoted (pipe:cat /data/{{name}}): "
                             "the file name is shell-quoted when it is put in")
        at = location.find("{name}", at + 1)


# --------------------------------------------------------------------------- bounded reads


def _too_large(where: str, limit: int, size: Optional[int] = None) -> TooLargeError:
    got = f"{size} bytes" if size is not None else "more"
    return TooLargeError(f"{where}: larger than expected (at most {limit} bytes, found {got})", limit)


def read_local_file(path: str | os.PathLike, limit: int = MAX_READ_BYTES) -> bytes:
    """The bytes of the regular file ``path``: FileNotFoundError / IsADirectoryError / OSError as from
    ``open``; DataError when it is not a regular file (a device, FIFO, socket: checked before it is opened);
    TooLargeError when it holds more than ``limit`` bytes (nothing is read then)."""
    st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(21, "Is a directory", str(path))
    if not stat.S_ISREG(st.st_mode):
        kind = ("a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else
                "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a file")
        raise DataError(f"{path}: not a regular file ({kind}); the files of a shard set must be regular files")
    if st.st_size > limit:
        raise _too_large(str(path), limit, st.st_size)
    with open(path, "rb") as f:
        data = f.read(st.st_size + 1)            # one more: a file that grew since the stat is not taken
    if len(data) > st.st_size:
        raise DataError(f"{path}: changed while it was read (it grew past {st.st_size} bytes)")
    return data


def _read_stream(stream, where: str, limit: int) -> bytes:
    """At most ``limit`` bytes of a file object, in chunks; TooLargeError at byte ``limit + 1``."""
    chunks, total = [], 0
    while total <= limit:
        b = stream.read(min(_CHUNK, limit + 1 - total))
        if not b:
            break
        chunks.append(b)
        total += len(b)
    if total > limit:
        raise _too_large(where, limit)
    return b"".join(chunks)


def _kill(proc: subprocess.Popen, group: bool) -> None:
    try:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _collect(proc: subprocess.Popen, limit: int, timeout_s: float, group: bool) -> tuple[bytes, bytes, int]:
    """(stdout up to ``limit + 1`` bytes, the end of stderr, exit status) of ``proc``. The process (its
    group with ``group``) is killed when it writes more than ``limit`` bytes (status None then) or does
    not finish within ``timeout_s`` (UrlError)."""
    deadline = time.monotonic() + timeout_s
    out = proc.stdout.fileno()
    err = proc.stderr.fileno() if proc.stderr is not None else None
    chunks, total, tail = [], 0, b""
    sel = selectors.DefaultSelector()                # epoll: no FD_SETSIZE limit, unlike select()
    try:
        for fd in (out, err):
            if fd is not None:
                sel.register(fd, selectors.EVENT_READ)
        while out in sel.get_map() and total <= limit:
            left = deadline - time.monotonic()
            ready = sel.select(left) if left > 0 else []
            if not ready:
                raise UrlError(f"timed out after {timeout_s:g} s (the read time limit)")
            for key, _ in ready:
                b = os.read(key.fd, min(_CHUNK, limit + 1 - total) if key.fd == out else 4096)
                if not b:
                    sel.unregister(key.fd)
                elif key.fd == out:
                    chunks.append(b)
                    total += len(b)
                else:
                    tail = (tail + b)[-4096:]
        if total > limit:
            _kill(proc, group)
            return b"".join(chunks), tail, None
        try:
            status = proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            raise UrlError(f"timed out after {timeout_s:g} s (the command closed its output but did not "
                           "end)") from None
        while err is not None and err in sel.get_map() and sel.select(0):
            b = os.read(err, 4096)
            if not b:
                break
            tail = (tail + b)[-4096:]
    except BaseException:
        _kill(proc, group)
        raise
    finally:
        sel.close()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    return b"".join(chunks), tail, status


def _spawn(args, *, shell: bool = False, stderr=None) -> subprocess.Popen:
    return subprocess.Popen(args, shell=shell, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr,
                            start_new_session=True)


def _curl_args(url: str, limit: int, timeout_s: float) -> list[str]:
    return ["curl", "-sS", "-f", "-L", "--connect-timeout", "30", "--max-time", f"{timeout_s:g}",
            "--max-filesize", str(limit), "--", url]


def _read_process(url: str, scheme: str, limit: int, timeout_s: float) -> bytes:
    """One read of a URL served by a process: curl (http, https), the shell (pipe:) or gopen's command."""
    from webdataset.gopen import Pipe, gopen

    stream = None
    try:
        if scheme in ("http", "https"):
            proc, group = _spawn(_curl_args(url, limit, timeout_s), stderr=subprocess.PIPE), True
        elif scheme == "pipe":
            proc, group = _spawn(url[5:], shell=True), True
        else:
            stream = gopen(url, "rb")
            proc, group = getattr(stream, "proc", None), False
    except FileNotFoundError as e:
        what = "curl is not installed (http(s) URLs are read with curl)" if scheme in ("http", "https") \
            else f"no such file ({e.strerror})"
        raise UrlError(what, permanent=True) from None
    except PermissionError as e:
        raise UrlError(f"permission denied ({e.strerror})", permanent=True) from None
    except ValueError as e:  # gopen: no handler for the scheme
        raise UrlError(f"no opener for the URL scheme {scheme!r} ({e}); webdataset opens http, https, pipe, "
                       f"file, ... (for other stores use pipe:COMMAND with {{name}})", permanent=True) from None
    except OSError as e:
        raise UrlError(f"cannot open ({e})", permanent=False) from None
    if stream is not None and not isinstance(stream, Pipe):     # a scheme without a process
        try:
            with stream:
                return _read_stream(stream, url, limit)
        except OSError as e:
            raise UrlError(f"read error ({e})", permanent=False) from None
    data, err, status = _collect(proc, limit, timeout_s, group)
    if status is None or (scheme in ("http", "https") and status == 63):   # 63: curl's --max-filesize
        raise _too_large(url, limit)
    if status == 0 or (scheme == "pipe" and status == 141):   # 141: SIGPIPE in the command (as gopen)
        return data
    if scheme in ("http", "https"):
        text = err.decode("utf-8", "replace").strip()
        m = re.search(r"returned error: (\d{3})", text)
        if m:
            code = int(m.group(1))
            transient = code >= 500 or code in (408, 429)
            raise UrlError(f"HTTP {code}", permanent=not transient)
        if status == 28:
            raise UrlError(f"timed out after {timeout_s:g} s (the read time limit; curl: {text})")
        raise UrlError(f"curl exit {status}: {text or 'no error text'}", permanent=status in (1, 3))
    raise UrlError(f"the command exited with status {status} (its error output is above)", permanent=False)


def _read_once(url: str, limit: int, timeout_s: float) -> bytes:
    """One read of ``url``; UrlError(permanent=...) on failure, TooLargeError past ``limit`` bytes."""
    scheme = _SCHEME.match(url).group(1).lower()
    if scheme != "file":
        return _read_process(url, scheme, limit, timeout_s)
    path = re.sub(r"^file://?", "", url)
    try:
        return read_local_file(path, limit)
    except TooLargeError:
        raise _too_large(url, limit) from None
    except FileNotFoundError as e:
        raise UrlError(f"no such file ({e.strerror})", permanent=True) from None
    except IsADirectoryError:
        raise UrlError("is a directory", permanent=True) from None
    except PermissionError as e:
        raise UrlError(f"permission denied ({e.strerror})", permanent=True) from None
    except OSError as e:
        raise UrlError(f"read error ({e})", permanent=False) from None


def read_url(url: str, what: str, policy: Optional[RetryPolicy] = None, limit: int = MAX_READ_BYTES) -> bytes:
    """The whole content of ``url`` (at most ``limit`` bytes), retried on transient failures (see the module
    docstring); UrlError naming ``what`` and the URL, TooLargeError (not retried) past ``limit`` bytes."""
    policy = policy or _default
    wait = policy.wait_s
    for attempt in range(1, policy.attempts + 1):
        try:
            return _read_once(url, limit, policy.timeout_s)
        except TooLargeError as e:
            raise TooLargeError(f"{what}: {e}", limit) from None
        except UrlError as e:
            if e.permanent or attempt == policy.attempts:
                tries = "" if e.permanent else f" (gave up after {attempt} attempt{'s' * (attempt > 1)})"
                raise UrlError(f"{what}: cannot read {url}: {e}{tries}", e.permanent) from None
            log.warning("%s: reading %s failed: %s (attempt %d of %d); retrying in %.1f s", what, url, e, attempt,
                        policy.attempts, wait)
        time.sleep(wait)
        wait = min(policy.max_wait_s, wait * 2 if wait > 0 else 0)
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- the location of a set


class ShardSource:
    """A shard-set location (directory or URL prefix) and how to read its files."""

    def __init__(self, location: str | os.PathLike, retry: Optional[RetryPolicy] = None):
        self.location = location if is_url(location) else Path(location)
        self.is_url = is_url(location)
        self.retry = retry or _default
        self.scheme = _SCHEME.match(location).group(1).lower() if self.is_url else None

    def __str__(self) -> str:
        return str(self.location)

    def __repr__(self) -> str:
        return f"ShardSource({str(self.location)!r})"

    def __reduce__(self):  # picklable for DataLoader workers (the policy travels with it)
        return (ShardSource, (str(self.location) if self.is_url else self.location, self.retry))

    def child(self, name: str) -> str:
        """The path or URL of file ``name`` of the set: a plain base name (DataError otherwise), escaped for
        the URL (shell-quoted in a ``pipe:`` command, percent-encoded in http(s); module docstring)."""
        check_name(name, f"{self.location}: file name")
        if not self.is_url:
            return str(self.location / name)
        if self.scheme == "pipe":
            put = shlex.quote(name)
        elif self.scheme in ("http", "https"):
            put = urllib.parse.quote(name, safe="")
        else:
            put = name
        if "{name}" in self.location:
            if self.scheme == "pipe":
                _check_pipe_slots(self.location)
            return self.location.replace("{name}", put)
        return self.location.rstrip("/") + "/" + put

    def local_path(self, name: str) -> Optional[Path]:
        return None if self.is_url else self.location / check_name(name, f"{self.location}: file name")

    def read(self, name: str, what: str, limit: int = MAX_READ_BYTES) -> bytes:
        """Bytes of file ``name`` (at most ``limit``): FileNotFoundError / OSError (local), UrlError (URL), or
        DataError (an unsafe name, not a regular file); TooLargeError when it holds more than ``limit``."""
        if self.is_url:
            return read_url(self.child(name), what, self.retry, limit)
        return read_local_file(self.local_path(name), limit)
