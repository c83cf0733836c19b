"""Output files: checked before any work starts, written atomically, all or none.

Every command that writes files (``g5 run --trace/--timeline``, and any later one) goes
through this module:

    targets = check_outputs({"--trace": "t.json", "--timeline": "ops.csv"}, inputs=[config])
    ...                                   # the simulation
    targets.write({"--trace": dump_trace, "--timeline": dump_csv})

:func:`check_outputs` refuses, with one line naming the option, a path whose folder is
missing or not writable, a path that is (or resolves to) an input file, two options that
name the same file, and a target that exists but is not a regular file (a folder, a device
such as ``/dev/full``, a FIFO, a socket). A symlink to a regular file is followed: the
target file is written and the link stays a link.

:meth:`OutputTargets.write` writes every file to a temporary name in its own folder first
and renames them into place only when all of them were written, so a failed write leaves
none of the requested files changed and no temporary file behind.
:meth:`OutputTargets.write_each` writes each file on its own, as atomically: where the
outputs are independent (``g5 run --trace`` and ``--timeline``), one that cannot be written
(a full file system under a large trace) does not keep the others from being written.
"""
from __future__ import annotations

import os
import pathlib
import stat
import tempfile
from typing import Callable, Iterable, Mapping, Optional

import attrs

from g5core.api.errors import ConfigError

__all__ = ["OutputError", "OutputTargets", "check_output_path", "check_outputs", "write_atomically"]


class OutputError(ConfigError):
    """An output path cannot be written; the message names the option and the path."""

    def __init__(self, option: str, message: str):
        self.option = option
        super().__init__(option, message)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _identity(path: str) -> Optional[tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _can_create_in(folder: str) -> bool:
    """Whether a file can be created in ``folder`` (tried, since permission bits do not tell
    for root or on a read-only file system)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".g5-probe.", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(tmp)
    return True


@attrs.frozen
class OutputTarget:
    option: str      # the option or label that named it, e.g. "--trace"
    given: str       # the path as the user wrote it
    real: str        # the file that will be written (symlinks resolved)


def _check_one(option: str, given, inputs: Mapping[str, tuple[str, Optional[tuple[int, int]]]]) -> OutputTarget:
    text = os.fspath(given)
    if not text:
        raise OutputError(option, "empty path; give a file name")
    real = os.path.realpath(os.path.expanduser(text))
    where = f"'{text}'" + (f" (a link to '{real}')" if os.path.islink(os.path.expanduser(text)) else "")
    try:
        st = os.stat(real)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    except OSError as exc:
        raise OutputError(option, f"cannot write {where}: {exc.strerror or exc}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OutputError(option, f"{where} is {_kind(st.st_mode)}; give the path of a regular file")
    ident = (st.st_dev, st.st_ino) if st is not None else None
    for label, (in_real, in_ident) in inputs.items():
        if real == in_real or (ident is not None and ident == in_ident):
            raise OutputError(option, f"{where} is the input {label}; writing it would destroy it; "
                                      "give another output path")
    parent = os.path.dirname(real) or "."
    if not os.path.exists(parent):
        raise OutputError(option, f"cannot write {where}: the folder '{parent}' does not exist; create it first")
    if not os.path.isdir(parent):
        raise OutputError(option, f"cannot write {where}: '{parent}' is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK) or not _can_create_in(parent):
        raise OutputError(option, f"cannot write {where}: the folder '{parent}' is not writable")
    if st is not None and not os.access(real, os.W_OK):
        raise OutputError(option, f"cannot write {where}: the file exists and is read-only")
    return OutputTarget(option, text, real)


@attrs.frozen
class OutputTargets:
    """Checked output paths, by option; write them with :meth:`write`."""

    targets: tuple[OutputTarget, ...]

    def __bool__(self) -> bool:
        return bool(self.targets)

    def path(self, option: str) -> Optional[str]:
        for t in self.targets:
            if t.option == option:
                return t.given
        return None

    def write(self, writers: Mapping[str, Callable], binary: bool = False) -> None:
        """Call ``writers[option](fh)`` for every target (text mode, UTF-8; bytes when
        ``binary``), then rename all.

        The renames start only after every temporary file was written, so a failed write
        replaces none of the files (a rename within one folder does not fail short of the
        folder vanishing meanwhile); raises OutputError naming the option."""
        missing = [t.option for t in self.targets if t.option not in writers]
        if missing:
            raise ValueError(f"no writer for {', '.join(missing)}")
        staged: list[tuple[OutputTarget, str]] = []
        try:
            for t in self.targets:
                staged.append((t, _stage(t, writers[t.option], binary)))
            for t, tmp in staged:
                try:
                    os.replace(tmp, t.real)
                except OSError as exc:
                    raise OutputError(t.option, f"cannot write '{t.given}': {exc.strerror or exc}") from None
            staged = []
        finally:
            for _, tmp in staged:
                if os.path.exists(tmp):
                    os.unlink(tmp)


    def write_each(self, writers: Mapping[str, Callable], binary: bool = False
                   ) -> tuple[list[str], Optional[OutputError]]:
        """Write every target on its own (each atomically: a temporary file, then a rename),
        so that one that fails (a full file system under a large trace) leaves that file
        unchanged and the others still written. Returns the options written and, when some
        failed, one OutputError naming them and what was written."""
        written, failed = [], []
        for t in self.targets:
            try:
                OutputTargets((t,)).write({t.option: writers[t.option]}, binary)
            except OutputError as exc:
                failed.append(exc)
            else:
                written.append(t.option)
        if not failed:
            return written, None
        done = (f"; {', '.join(written)} {'was' if len(written) == 1 else 'were'} written" if written
                else "; nothing was written")
        first = str(failed[0])[len(failed[0].option) + 2:]   # its message, without "option: "
        return written, OutputError(failed[0].option, "; ".join([first] + [str(e) for e in failed[1:]]) + done)


def _stage(t: OutputTarget, dump: Callable, binary: bool = False) -> str:
    """Write ``t`` to a temporary file next to its target; return the temporary path."""
    directory = os.path.dirname(t.real) or "."
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(t.real)}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise OutputError(t.option, f"cannot write '{t.given}': {exc.strerror or exc}") from None
    try:
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="")) as fh:
            dump(fh)
        try:
            mode = stat.S_IMODE(os.stat(t.real).st_mode)  # an existing file keeps its mode
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask  # mkstemp makes 0600; a new file gets the usual mode
        os.chmod(tmp, mode)
    except BaseException as exc:
        os.unlink(tmp)
        if isinstance(exc, OSError):
            raise OutputError(t.option, f"cannot write '{t.given}': {exc.strerror or exc}") from None
        raise
    return tmp


def check_outputs(outputs: Mapping[str, object], inputs: Iterable = ()) -> OutputTargets:
    """Check every requested output path (``None`` entries are skipped) before any work.

    ``outputs`` maps an option name to a path; ``inputs`` are the files the command reads
    (paths, or ``(label, path)`` pairs), which no output may overwrite."""
    known: dict[str, tuple[str, Optional[tuple[int, int]]]] = {}
    for item in inputs:
        label, path = item if isinstance(item, tuple) else ("file", item)
        if path is None:
            continue
        p = os.path.expanduser(os.fspath(path))
        if os.path.exists(p):
            known[f"{label} '{os.fspath(path)}'"] = (os.path.realpath(p), _identity(p))
    targets: list[OutputTarget] = []
    for option, path in outputs.items():
        if path is None:
            continue
        t = _check_one(option, path, known)
        for other in targets:
            if other.real == t.real or (_identity(t.real) is not None and _identity(t.real) == _identity(other.real)):
                raise OutputError(option, f"'{t.given}' is also the {other.option} file; give each output its own path")
        targets.append(t)
    return OutputTargets(tuple(targets))


def check_output_path(path, option: str, inputs: Iterable = ()) -> pathlib.Path:
    """One output path checked as :func:`check_outputs` checks it; returns the file that will
    be written (a symlink's target)."""
    return pathlib.Path(check_outputs({option: path}, inputs).targets[0].real)


def write_atomically(path, dump: Callable, option: str = "output", binary: bool = False) -> None:
    """Check ``path`` and write it through a temporary file and a rename (one output)."""
    check_outputs({option: path}).write({option: dump}, binary)
