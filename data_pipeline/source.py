"""Where a shard set lives: a local directory or a URL prefix, read whole with bounded retries.

A *location* is either a directory or a URL understood by webdataset's opener
(:func:`webdataset.gopen.gopen`): ``http://`` / ``https://`` (curl), ``pipe:COMMAND`` (the
command's stdout), ``file:`` and the other schemes webdataset registers. A file of the set is
found by appending ``/<name>`` to the location, or, when the location contains ``{name}``, by
putting the name there (``pipe:aws s3 cp s3://bucket/set/{name} -``).

Reading a URL: transient failures (HTTP 5xx/408/429, connection errors and time-outs, a
``pipe:`` command that fails, an I/O error) are retried ``RetryPolicy.attempts`` times in all,
waiting ``wait_s``, then twice as long each time (at most ``max_wait_s``), each retry logged as
a warning; a permanent failure (HTTP 404 and the other 4xx, a missing ``file:``) is raised at
once. Either way the :class:`~data_pipeline.errors.DataError` names the URL.

Why http(s) does not go through ``gopen`` itself: webdataset runs ``curl -f -s --retry 30
--retry-delay 2``, which retries silently at a fixed 2 s for up to a minute and discards curl's
error text, so a 404 surfaces as "exit 22" without the status. We run curl through webdataset's
:class:`~webdataset.gopen.Pipe` with ``-sS`` and no retries of its own, read its error text, and
do the bounded, logged back-off here. ``pipe:``, ``file:`` and the other schemes use ``gopen``.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import DataError

__all__ = ["RetryPolicy", "set_default_retry", "default_retry", "is_url", "ShardSource", "UrlError",
           "read_url"]

log = logging.getLogger(__name__)

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")   # two letters at least: C:\ is a path


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    """Reads of one URL in all (1 = no retry)."""
    wait_s: float = 1.0
    """Wait before the first retry; doubled before each further one."""
    max_wait_s: float = 30.0
    """Upper bound of one wait."""


_default = RetryPolicy()


def set_default_retry(policy: RetryPolicy) -> None:
    """The policy of sources created without one (the trainer sets it from ``data.url_retries``)."""
    global _default
    if policy.attempts < 1 or policy.wait_s < 0:
        raise ValueError(f"retry policy: expected attempts >= 1 and wait_s >= 0, got {policy}")
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


def _curl(url: str):
    from webdataset.gopen import Pipe

    return Pipe(["curl", "-sS", "-f", "-L", "--connect-timeout", "30", url], mode="rb",
                stderr=subprocess.PIPE, ignore_errors=True, timeout=600)


def _read_once(url: str) -> bytes:
    """One read of ``url``; UrlError(permanent=...) on failure."""
    from webdataset.gopen import Pipe, gopen, set_options

    scheme = _SCHEME.match(url).group(1).lower()
    try:
        stream = _curl(url) if scheme in ("http", "https") else gopen(url, "rb")
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
    if not isinstance(stream, Pipe):
        try:
            with stream:
                return stream.read()
        except IsADirectoryError:
            raise UrlError("is a directory", permanent=True) from None
        except OSError as e:
            raise UrlError(f"read error ({e})", permanent=False) from None
    set_options(stream, ignore_errors=True)   # we read the status ourselves
    try:
        data = stream.read()
    finally:
        stream.close()
    status = stream.status
    if status in (0, None):
        return data
    if scheme in ("http", "https"):
        err = stream.proc.stderr.read().decode("utf-8", "replace").strip() if stream.proc.stderr else ""
        m = re.search(r"returned error: (\d{3})", err)
        if m:
            code = int(m.group(1))
            transient = code >= 500 or code in (408, 429)
            raise UrlError(f"HTTP {code}", permanent=not transient)
        raise UrlError(f"curl exit {status}: {err or 'no error text'}", permanent=status in (1, 3))
    raise UrlError(f"the command exited with status {status} (its error output is above)", permanent=False)


def read_url(url: str, what: str, policy: Optional[RetryPolicy] = None) -> bytes:
    """The whole content of ``url``, retried on transient failures (see the module docstring)."""
    policy = policy or _default
    wait = policy.wait_s
    for attempt in range(1, policy.attempts + 1):
        try:
            return _read_once(url)
        except UrlError as e:
            if e.permanent or attempt == policy.attempts:
                tries = "" if e.permanent else f" (gave up after {attempt} attempt{'s' * (attempt > 1)})"
                raise UrlError(f"{what}: cannot read {url}: {e}{tries}", e.permanent) from None
            log.warning("%s: reading %s failed: %s (attempt %d of %d); retrying in %.1f s", what, url, e, attempt,
                        policy.attempts, wait)
        time.sleep(wait)
        wait = min(policy.max_wait_s, wait * 2 if wait > 0 else 0)
    raise AssertionError("unreachable")


class ShardSource:
    """A shard-set location (directory or URL prefix) and how to read its files."""

    def __init__(self, location: str | os.PathLike, retry: Optional[RetryPolicy] = None):
        self.location = location if is_url(location) else Path(location)
        self.is_url = is_url(location)
        self.retry = retry or _default

    def __str__(self) -> str:
        return str(self.location)

    def __repr__(self) -> str:
        return f"ShardSource({str(self.location)!r})"

    def __reduce__(self):  # picklable for DataLoader workers (the policy travels with it)
        return (ShardSource, (str(self.location) if self.is_url else self.location, self.retry))

    def child(self, name: str) -> str:
        """The path or URL of file ``name`` of the set."""
        if not self.is_url:
            return str(self.location / name)
        if "{name}" in self.location:
            return self.location.replace("{name}", name)
        return self.location.rstrip("/") + "/" + name

    def local_path(self, name: str) -> Optional[Path]:
        return None if self.is_url else self.location / name

    def read(self, name: str, what: str) -> bytes:
        """Bytes of file ``name``; FileNotFoundError (local) or UrlError (URL) naming it."""
        if self.is_url:
            return read_url(self.child(name), what, self.retry)
        return (self.location / name).read_bytes()
