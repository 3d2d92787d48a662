"""``kvpool auth``: the pool secret and the credentials issued from it (kvpool.auth).

Where the secret is read from, first found: ``--secret-file F``, ``$KVPOOL_SECRET_FILE`` (a
mounted Kubernetes Secret), ``$KVPOOL_SECRET``, then ``~/.kvpool/secret`` (what ``kvpool auth
init`` and ``kvpool up`` write). The secret itself is never printed.
"""

from __future__ import annotations

import argparse
import os

from kvpool import auth
from kvpool.errors import BadRequest
from kvpool.private import read_private

DEFAULT_FILE = os.path.join("~", ".kvpool", "secret")
_FIX = ("pass --secret-file F, set KVPOOL_SECRET_FILE (a mounted Secret) or KVPOOL_SECRET, "
        "or create one with `kvpool auth init`")


def default_path(env: dict | None = None) -> str:
    env = os.environ if env is None else env
    return env.get(auth.SECRET_FILE_ENV) or os.path.expanduser(DEFAULT_FILE)


def write_private(path: str, text: str, what: str, flag: str) -> str:
    """Writes ``text`` to ``path`` atomically (a reader never sees half of it), mode 0600, its folder
    0700 when made here; its absolute path. A failure is a BadRequest naming ``flag``."""
    path = os.path.abspath(os.path.expanduser(path))
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise BadRequest(f"cannot write {what} to {path} ({e.strerror}): pass {flag} with a path you can "
                         "write") from None
    return path


def write_secret(path: str, force: bool = False) -> str:
    """Writes a new pool secret to ``path`` (mode 0600, its folder 0700 when made here)."""
    path = os.path.expanduser(path)
    if os.path.exists(path) and not force:
        raise BadRequest(f"{path} already holds a pool secret: keep it, or pass --force to replace it "
                         "(every credential issued from the old one stops verifying)")
    write_private(path, auth.new_secret() + "\n", "a pool secret", "--secret-file")
    return path


def _read(path: str) -> str:
    try:
        text = read_private(path, "the pool secret").strip()
    except OSError as e:
        raise BadRequest(f"cannot read the pool secret at {path} ({e.strerror}): {_FIX}") from None
    auth.Authority(text)  # at least 16 bytes, or a BadRequest saying how to make one
    return text


def find_secret(secret_file: str | None = None, env: dict | None = None,
                create: bool = False) -> tuple[str, str]:
    """(the pool secret, where it came from). ``create``: a missing ``secret_file`` (or, with no
    other source, ``~/.kvpool/secret``) is made first; otherwise a missing secret is a BadRequest
    naming the fix."""
    env = os.environ if env is None else env
    if secret_file:
        path = os.path.expanduser(secret_file)
        if create and not os.path.exists(path):
            write_secret(path)
            return _read(path), f"{path} (new)"
        return _read(path), path
    if env.get(auth.SECRET_FILE_ENV):
        return _read(env[auth.SECRET_FILE_ENV]), f"${auth.SECRET_FILE_ENV} ({env[auth.SECRET_FILE_ENV]})"
    if env.get(auth.SECRET_ENV):
        auth.Authority(env[auth.SECRET_ENV])
        return env[auth.SECRET_ENV].strip(), f"${auth.SECRET_ENV}"
    path = os.path.expanduser(DEFAULT_FILE)
    if os.path.exists(path):
        return _read(path), path
    if create:
        write_secret(path)
        return _read(path), f"{path} (new)"
    raise BadRequest(f"no pool secret: {_FIX}")


def secret_path(secret_file: str | None, where: str) -> str | None:
    """The file the pool secret came from (kvpool.auth_cli.find_secret's ``where``), None when it
    came from ``$KVPOOL_SECRET``: the pool's processes read that file (on every node of a Ray pool)."""
    if where == "$KVPOOL_SECRET":
        return None
    path = secret_file or os.environ.get(auth.SECRET_FILE_ENV) or where.split(" (")[0]
    return os.path.abspath(os.path.expanduser(path))


def _init(args: argparse.Namespace) -> int:
    path = write_secret(args.secret_file or default_path(), force=args.force)
    print(f"pool secret written to {path} (mode 0600); issue credentials with `kvpool auth issue TENANT"
          + (f" --secret-file {path}`" if args.secret_file else "`"))
    return 0


def _issue(args: argparse.Namespace) -> int:
    from kvpool.index.base import check_name

    check_name("tenant", args.tenant)  # the index's rule: a tenant the pool can register
    secret, _ = find_secret(args.secret_file)
    credential = auth.Authority(secret).issue(args.tenant, args.role)
    print(auth.request_secret(credential) if args.request_secret else credential)
    return 0


def add_auth_parser(sub) -> None:
    a = sub.add_parser("auth", help="the pool secret and tenant credentials")
    asub = a.add_subparsers(dest="auth_command", required=True)
    i = asub.add_parser("init", help="write a new pool secret (mode 0600)")
    i.add_argument("--secret-file", help=f"where (default: $KVPOOL_SECRET_FILE, else {DEFAULT_FILE})")
    i.add_argument("--force", action="store_true", help="replace an existing secret (old credentials stop verifying)")
    i.set_defaults(func=_init)
    s = asub.add_parser("issue", help="print a tenant's credential, or the request secret its engine's API users send")
    s.add_argument("tenant")
    s.add_argument("--role", choices=["tenant", "operator"], default="tenant")
    s.add_argument("--request-secret", action="store_true",
                   help="print the request secret (vLLM's cache_salt, SGLang's extra info) instead of the credential")
    s.add_argument("--secret-file", help=f"the pool secret (default: $KVPOOL_SECRET_FILE, $KVPOOL_SECRET, {DEFAULT_FILE})")
    s.set_defaults(func=_issue)
