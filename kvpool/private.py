"""Files that hold a secret (the pool secret, the Ray token, an engine's credentials): read only
while nobody but their owner can read them.

A file whose mode gives its group or anyone else access (``mode & 0o077``) is refused with the
``chmod 600`` that fixes it. The mode checked is the target's: a mounted Kubernetes Secret is a
link into ``..data/``, and ``os.stat`` follows links. One exception, the way Kubernetes mounts a
Secret for a pod that does not run as root: a file owned by root, read by another user through
its group (the pod's ``fsGroup``: the kubelet makes a ``defaultMode: 0400`` file 0440, group
fsGroup) passes; other users' access never does.

The files the pool writes itself are created 0600 (``kvpool.auth_cli.write_private``).
"""

from __future__ import annotations

import os

from kvpool.errors import BadRequest


def check_private(path: str, what: str, st: os.stat_result | None = None) -> None:
    """Raises a BadRequest naming ``chmod 600 PATH`` when ``path`` (followed through links; or
    ``st``, its stat) can be read by anyone but its owner; an OSError when it cannot be looked at."""
    st = os.stat(path) if st is None else st
    mode = st.st_mode & 0o777
    if not mode & 0o077:
        return
    through_group = (not mode & 0o007 and st.st_uid == 0 and os.geteuid() != 0
                     and (st.st_gid == os.getegid() or st.st_gid in os.getgroups()))
    if through_group:
        return  # a Kubernetes Secret mounted with fsGroup: root's file, this pod's group
    real = os.path.realpath(path)
    shown = path if real == path else f"{path} (-> {real})"
    raise BadRequest(f"{what} {shown} has mode {mode:04o}: users other than its owner can read it, so it is not "
                     f"used. Run `chmod 600 {real}` (a Kubernetes Secret: mount it with defaultMode: 0400)")


def read_private(path: str, what: str, binary: bool = False) -> str | bytes:
    """The content of ``path``, checked by :func:`check_private` on the file it opened (no swap
    between the check and the read); an OSError when it cannot be read."""
    with open(path, "rb") as f:
        check_private(path, what, os.fstat(f.fileno()))
        data = f.read()
    return data if binary else data.decode("utf-8")
