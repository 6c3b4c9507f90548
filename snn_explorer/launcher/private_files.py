"""Files only their owner can touch: the job directory an export writes and the payload a job reads.

An exported job unpickles ``payload.pkl`` (the model and code) as the user who runs it, so the
directory must be one that no other user can write into, and no file in it may be followed
through a symlink or replaced. Writes go through a directory descriptor (``O_NOFOLLOW``),
replace any old entry by unlinking it first (safe: nobody else can write the directory) and
create the new file with ``O_EXCL``.
"""
from __future__ import annotations

import os
import stat
from typing import Union

try:
    import pwd
except ImportError:  # not on Windows: owners are shown by uid
    pwd = None

#: Modes of what an export writes: data only its owner reads, scripts only its owner runs.
FILE_MODE, SCRIPT_MODE = 0o600, 0o700
_UNSAFE_BITS = stat.S_IWGRP | stat.S_IWOTH


def _whose(uid: int) -> str:
    if pwd is None:
        return f"uid {uid}"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def check_private(st: os.stat_result, what: str) -> None:
    """Refuse ``what`` (its ``stat``) unless the running user owns it and no one else can write it."""
    if st.st_uid != os.getuid():
        raise PermissionError(f"{what} belongs to {_whose(st.st_uid)}, not to the running user "
                              f"{_whose(os.getuid())}; use a directory of your own")
    if st.st_mode & _UNSAFE_BITS:
        raise PermissionError(f"{what} is writable by other users (mode {stat.filemode(st.st_mode)}); "
                              "only its owner may write it (chmod go-w)")


class PrivateDir:
    """An open job directory: owned by the user, not writable by others, entered without symlinks."""

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = os.path.abspath(os.fspath(path))
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        except FileExistsError:
            raise NotADirectoryError(f"job directory {self.path!r} exists and is not a directory") from None
        if os.path.islink(self.path):
            raise PermissionError(f"job directory {self.path!r} is a symlink; give the real directory")
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            check_private(os.fstat(self.fd), f"job directory {self.path!r}")
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, name: str, data: Union[str, bytes], mode: int = FILE_MODE) -> str:
        """Write ``name`` afresh (never through a symlink, never into an old file); its path."""
        if isinstance(data, str):
            data = data.encode()
        try:
            os.unlink(name, dir_fd=self.fd)  # an old export's file (or a planted entry)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            raise IsADirectoryError(f"{os.path.join(self.path, name)!r} is a directory; remove it first") from None
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=self.fd)
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fd, mode)  # the umask does not widen or narrow it
            fh.write(data)
        return os.path.join(self.path, name)

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> "PrivateDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_private(path: Union[str, os.PathLike], what: str) -> bytes:
    """The bytes of ``path`` if the running user owns it and no one else can write it or its directory."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if os.path.islink(path):
            raise PermissionError(f"{what} {path!r} is a symlink; refusing to follow it") from None
        raise type(exc)(exc.errno, f"cannot open {what} {path!r}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        check_private(os.fstat(fd), f"{what} {path!r}")
        check_private(os.stat(os.path.dirname(os.path.abspath(path))), f"the directory of {what} {path!r}")
        return fh.read()
