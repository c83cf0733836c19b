"""Output files of sweeps, plots and reports: checked before any work, written atomically.

``check_output_path`` is the one place that decides whether a path may be written; the
generic output-path checker of the run command can replace it without touching callers.
"""
from __future__ import annotations

import os
import pathlib
import stat
import tempfile
from typing import Callable, Iterable

from .errors import ConfigError


def check_output_path(path, option: str, inputs: Iterable = ()) -> pathlib.Path:
    """Refuse an output path that cannot or must not be written, before any work starts.

    The folder must exist and be writable; the target must not be a folder, a device or
    another special file, nor one of ``inputs``. A symbolic link to a regular file is
    written through (the link stays). Returns the path to write (the link's target).
    """
    p = pathlib.Path(path)
    if str(path) == "":
        raise ConfigError(option, "needs a file name")
    target = pathlib.Path(os.path.realpath(p)) if p.is_symlink() else p
    parent = target.parent if str(target.parent) else pathlib.Path(".")
    if not parent.exists():
        raise ConfigError(option, f"folder {parent} does not exist; create it first or choose another path")
    if not parent.is_dir():
        raise ConfigError(option, f"{parent} is not a folder; choose another path")
    if target.exists():
        mode = os.stat(target).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(option, f"{p} is a folder; give a file name")
        if not stat.S_ISREG(mode):
            raise ConfigError(option, f"{p} is not a regular file (a device, pipe or socket); choose another path")
        if not os.access(target, os.W_OK):
            raise ConfigError(option, f"{p} is not writable; choose another path")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(option, f"folder {parent} is not writable; choose another path")
    for other in inputs:
        if other is not None and os.path.exists(other) and target.exists() and os.path.samefile(target, other):
            raise ConfigError(option, f"{p} is an input of this command; it would be overwritten")
    return target


def write_atomically(path, dump: Callable, binary: bool = False) -> None:
    """Write through a temporary file in the same folder, then rename: never a partial file.

    ``dump(fh)`` writes the content to an open file (UTF-8 text, or bytes when ``binary``).
    """
    path = pathlib.Path(path)
    directory = path.parent if str(path.parent) else pathlib.Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    try:
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="")) as fh:
            dump(fh)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
