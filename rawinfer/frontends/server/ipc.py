"""Local socket files (ipc://PATH): a private socket in a folder only this user may change, never taking
over a path that a live server or an ordinary file holds, and removed when the server exits.

ZeroMQ alone would give the socket the umask's permissions (anyone may connect under umask 000), unlink
whatever is at PATH before binding (an ordinary file, or the socket of a server still running, which then
keeps running unreachable) and may leave the file behind.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass

SOCKET_MODE = 0o600           # only this user may connect
FOLDER_MODE = 0o700           # for a folder the server creates


def ipc_path(endpoint: str) -> str | None:
    """The file path of an ipc:// endpoint; None for other transports."""
    scheme, sep, rest = endpoint.partition("://")
    return rest if sep and scheme == "ipc" else None


def is_abstract(path: str) -> bool:
    """Linux abstract sockets ('@name') have no file, hence no permissions: anyone on the host may connect."""
    return path.startswith("@") or path.startswith("\0")


def _check_folder(folder: str) -> None:
    if not os.path.isdir(folder):
        os.makedirs(folder, mode=FOLDER_MODE, exist_ok=True)
    st = os.stat(folder)
    if st.st_uid != os.getuid():
        raise OSError(f"the folder {folder} of the ipc socket belongs to another user; put the socket in a "
                      f"folder of your own (mkdir -m 700 DIR)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(f"the folder {folder} of the ipc socket is writable by other users, who could replace the "
                      f"socket; put it in a private folder (mkdir -m 700 DIR)")


def check_ipc_path(path: str) -> None:
    """OSError unless PATH may be bound: its folder is this user's and not writable by others, and PATH is
    absent or a socket file nobody listens on (left by a crash). A stale socket file is removed."""
    _check_folder(os.path.dirname(os.path.abspath(path)))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path} exists and is not a socket: refusing to replace it; choose another --bind path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise OSError(f"cannot tell whether {path} is in use ({e.strerror}); choose another --bind path") \
                from None
    else:
        raise OSError(f"another process is serving {path}: stop it, or choose another --bind path")
    finally:
        probe.close()
    os.unlink(path)                               # stale: nobody listens


@dataclass
class BoundSocketFile:
    """The socket file a server created: made private once bound, removed at exit if it is still ours."""
    path: str
    inode: int

    @classmethod
    def after_bind(cls, path: str) -> "BoundSocketFile":
        os.chmod(path, SOCKET_MODE)
        return cls(path, os.lstat(path).st_ino)

    def remove(self) -> None:
        try:
            if os.lstat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass


def bind_private(sock, endpoint: str) -> BoundSocketFile | None:
    """sock.bind(endpoint); for ipc://, checked first and created with mode 0600 (the umask is narrowed for
    the bind itself, so the file is never open to others). The socket file record for ipc, else None."""
    path = ipc_path(endpoint)
    if path is None:
        sock.bind(endpoint)
        return None
    check_ipc_path(path)
    old = os.umask(0o177)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old)
    return BoundSocketFile.after_bind(path)
