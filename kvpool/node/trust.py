"""Whom an engine trusts on its node: the run dir and the files in it, and the process behind the
shard's socket.

The run dir is the node's trust boundary (docs/security.md): whoever can write in it can stand a
socket, a page table and a slab of their own in the shard's place, answer an engine's calls,
receive its tenants' credentials and its KV, and serve it bytes of their choosing. So it is
trusted only when nobody but its owner can write in it (``mode & 0o022 == 0``: never a
world-writable, sticky ``/dev/shm``) and its owner is this process's user (or root); every file
an engine opens there (node file, socket, page table, slab) must be this user's (or root's), and
the process answering on the socket too (``SO_PEERCRED``). Above that, a client proves nothing to
a shard until the shard proved it holds the pool secret (kvpool.auth.shard_proof, asked per
credential by kvpool.node.connection).

The default run dir is ``/dev/shm/kvpool-<uid>``, which the shard makes 0700; one that exists with
another owner or looser mode is refused with the fix, never used.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import tempfile

from kvpool.errors import Forbidden

_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class UntrustedRunDir(Forbidden):
    """A run dir, or a file in it, that someone other than this user could have put there."""


def trusted_uids() -> frozenset[int]:
    return frozenset({os.geteuid(), 0})


def default_run_dir() -> str:
    """``/dev/shm/kvpool-<uid>`` (or the same under the temp dir where there is no /dev/shm): one per
    user, so users never share one, and made private by the shard that creates it."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"kvpool-{os.geteuid()}")


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def why_untrusted_dir(path: str) -> str | None:
    """None when ``path`` is a directory only this user (or root) can write in; else why not. A
    directory that does not exist is no answer either way: None."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        return f"cannot stat it ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid not in trusted_uids():
        return f"it belongs to {_owner(st.st_uid)}, not to this user ({_owner(os.geteuid())})"
    if st.st_mode & 0o022:
        return f"others can write in it (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_run_dir(path: str) -> None:
    """Raises :class:`UntrustedRunDir` naming the fix when ``path`` exists and is not private."""
    why = why_untrusted_dir(path)
    if why is not None:
        raise UntrustedRunDir(
            f"the kvpool run dir {path} is not trusted: {why}. Anyone who can write there can stand in for the "
            f"pool's shard and receive credentials and KV. Use a directory only the pool's user can write "
            f"(`mkdir -m 700 DIR` as that user; set $KVPOOL_RUN_DIR=DIR for the pool and its engines alike), or "
            f"leave $KVPOOL_RUN_DIR unset for the default {default_run_dir()}")


def ensure_run_dir(path: str) -> str:
    """The shard's side: ``path`` made (mode 0700) when missing, and refused unless private."""
    try:
        os.makedirs(path, 0o700, exist_ok=True)
    except OSError as e:
        raise UntrustedRunDir(f"cannot make the kvpool run dir {path} ({type(e).__name__}: {e.strerror}): make it "
                              f"yourself (`mkdir -m 700 {path}`) or set $KVPOOL_RUN_DIR to a directory of yours") from None
    check_run_dir(path)
    return path


def why_untrusted_file(path: str, kind: str = "file") -> str | None:
    """None when ``path`` is this user's (or root's) ``kind`` ("file" or "socket"), not a link, in
    a trusted directory; else why not."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot stat it ({e.strerror})"
    want = stat.S_ISSOCK if kind == "socket" else stat.S_ISREG
    if not want(st.st_mode):
        return f"it is not a {kind}" + (" (a symbolic link)" if stat.S_ISLNK(st.st_mode) else "")
    if st.st_uid not in trusted_uids():
        return f"it belongs to {_owner(st.st_uid)}, not to this user"
    parent = why_untrusted_dir(os.path.dirname(os.path.abspath(path)))
    return None if parent is None else f"its directory is not private: {parent}"


def check_file(path: str, what: str, kind: str = "file") -> None:
    why = why_untrusted_file(path, kind)
    if why is not None:
        raise UntrustedRunDir(f"not using {what} {path}: {why}. The shard's files are its user's (mode 0600) in a "
                              "private run dir; run the engine as the pool's user")


def check_peer(sock: socket.socket, path: str) -> None:
    """The process on the other end of a Unix socket runs as this user (or root), by the kernel's
    word (``SO_PEERCRED``), else :class:`UntrustedRunDir`."""
    try:
        _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except (OSError, AttributeError):  # not Linux: the file checks stand alone
        return
    if uid not in trusted_uids():
        raise UntrustedRunDir(f"the process answering on {path} runs as {_owner(uid)}, not as this user: not the "
                              "pool's shard; nothing sent to it")
