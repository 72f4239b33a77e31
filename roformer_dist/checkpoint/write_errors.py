"""What went wrong when a checkpoint file could not be written.

``torch.save`` reports write failures as ``RuntimeError`` without an errno ("unexpected pos", "file
write failed", "open file failed with strerror: ..."); :func:`storage_error` turns those and plain
``OSError`` into a :class:`~roformer_dist.errors.StorageError` naming the path and the OS reason,
asking the filesystem when torch did not say (read-only, no permission, full, or an I/O error).
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Optional

from roformer_dist.errors import StorageError

__all__ = ["storage_error"]


def storage_error(e: BaseException, doing: str, path: Path) -> Optional[StorageError]:
    """A StorageError for a failure to write ``path``, None when ``e`` is not one (a bug: re-raise it).

    torch.save reports write failures as RuntimeError without errno ("unexpected pos", "file write
    failed", "open file failed with strerror: ..."): the filesystem is asked what went wrong."""
    if isinstance(e, OSError):
        if e.errno is None:
            return None
        if not e.filename:
            e = OSError(e.errno, e.strerror or os.strerror(e.errno), str(path))
        return StorageError.from_os_error(e, doing)
    text = str(e)
    if not isinstance(e, RuntimeError) or not any(k in text for k in ("inline_container", "PytorchStreamWriter",
                                                                       "write failed", "open file failed")):
        return None
    code = None
    m = re.search(r"strerror: (.+?)\s*$", text, re.M)
    if m:
        code = {os.strerror(c): c for c in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EIO,
                                            errno.EPERM)}.get(m.group(1).strip())
    if code is None:
        code = _diagnose(path)
    return StorageError.from_os_error(OSError(code, os.strerror(code), str(path)), doing)


def _diagnose(path: Path) -> int:
    """errno of a write failure torch did not explain: read-only, no permission, full, or an I/O error."""
    d = path if path.is_dir() else path.parent
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        st = os.statvfs(d)
    except OSError:
        return errno.EIO
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if not os.access(d, os.W_OK):
        return errno.EACCES
    if st.f_bavail * st.f_frsize < 16 * 2**20:
        return errno.ENOSPC
    return errno.EIO
