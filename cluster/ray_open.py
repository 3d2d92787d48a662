"""Whether a Ray cluster answers a process that holds no token: what ``kvpool up --ray-address``
asks before it places the pool on a cluster it did not start (a client with a token connects to an
open cluster without a word from Ray, so the token alone proves nothing about the cluster)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

PROBE = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_get(b"kvpool-probe", None, timeout=float(sys.argv[2]))
except Exception as e:
    print("refused", type(e).__name__, str(e)[:200])
else:
    print("answered")
"""


def answers_without_token(address: str, timeout_s: float = 10.0) -> bool | None:
    """True when the Ray at ``address`` answers a tokenless client (its GCS reads its key-value
    store for anyone), False when it refuses one, None when the probe could not tell (it did not
    finish in time, or Ray's client is missing)."""
    with tempfile.TemporaryDirectory(prefix="kvpool-ray-probe-") as home:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update({"HOME": home, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
        try:
            r = subprocess.run([sys.executable, "-c", PROBE, address, str(timeout_s)], capture_output=True,
                               text=True, timeout=timeout_s + 20, env=env, cwd=home)
        except subprocess.TimeoutExpired:
            return None
    out = r.stdout.strip().splitlines()[-1:] or [""]
    if out[0] == "answered":
        return True
    return False if out[0].startswith("refused") else None
