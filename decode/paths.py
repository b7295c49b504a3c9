"""Output paths checked before long work: a run that measures or trains for minutes must not fail on its save.

`writable_dir` and `writable_file` raise a one-line UserError when an output is an existing file where a
folder is wanted (or the reverse), lies under a file, or cannot be written (read-only file system, no
permission). The check creates the folder (as the run would) and a probe file that it removes at once.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from decode.errors import UserError


def writable_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """`path` as a folder this process can write into (created when missing); else a UserError naming `flag`."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} '{p}' is an existing file, not a folder; give a folder path")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise UserError(f"{flag} '{p}' is not writable ({err.strerror or err.__class__.__name__}); "
                        "give a folder you can write to") from None
    return p


def writable_file(path: str | os.PathLike, flag: str = "--out") -> Path:
    """`path` as a file this process can create or replace (its folder is created); else a UserError."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} '{p}' is a folder; give a file path")
    parent = p.parent if str(p.parent) else Path(".")
    for above in [parent, *parent.parents]:  # a file where a folder is needed: name it, not a deep OSError
        if above.exists():
            if not above.is_dir():
                raise UserError(f"{flag} '{p}' lies under '{above}', which is a file; give a path in a folder")
            break
    writable_dir(parent, flag)
    if p.exists() and not os.access(p, os.W_OK):
        raise UserError(f"{flag} '{p}' exists and is not writable; give another path or fix its permissions")
    return p
