"""Token authentication when a run joins a Ray cluster (Ray >= 2.52, ``RAY_AUTH_MODE=token``).

Ray's documented way (docs.ray.io, "Ray token authentication"): every node and every driver of
the cluster runs with ``RAY_AUTH_MODE=token`` and the same token, taken from (first found)
``RAY_AUTH_TOKEN``, the file named by ``RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token``. A
driver given an explicit address (``trainer.ray_address=host:6379``, ``RAY_ADDRESS``) never turns
token mode on by itself.

Without this module a driver without the token (or with a wrong one) did not fail cleanly:
``ray.init`` retried for ~20 s, printing a C++ warning a second ("Unauthenticated: ...
InvalidAuthToken"), then raised "Failed to connect to Ray cluster", which says nothing about
tokens; with token mode on and no token anywhere, Ray's ``AuthenticationError`` came out as a
traceback. Here, before ``ray.init``, one GCS request (``GcsClient``, what ``ray.init`` itself
makes first) tells at once whether the cluster accepts this driver; a refusal becomes a
``UserError`` naming the address, what the driver sent and the fix. The token itself is never
printed.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

from engine.errors import UserError

MODE_VAR, TOKEN_VAR, TOKEN_PATH_VAR = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = Path("~/.ray/auth_token")
# the C++ client's own line for a refused token, printed to fd 2 before the Python error
_RAY_AUTH_WARNING = ("Unauthenticated", "InvalidAuthToken", "AuthenticationError")


def token_source(environ=os.environ) -> str:
    """Where Ray would take this driver's token from, in Ray's order; "" when nowhere."""
    if environ.get(TOKEN_VAR, "").strip():
        return TOKEN_VAR
    if environ.get(TOKEN_PATH_VAR, "").strip():
        return f"{TOKEN_PATH_VAR} ({environ[TOKEN_PATH_VAR]})"
    if DEFAULT_TOKEN_FILE.expanduser().is_file():
        return str(DEFAULT_TOKEN_FILE)
    return ""


def check_token_settings(address: str, environ=os.environ) -> None:
    """Refuse, before Ray reads them, settings that Ray treats as fatal (its C++ client ends the
    process with no word): ``RAY_AUTH_MODE=token`` with no token anywhere, and a
    ``RAY_AUTH_TOKEN_PATH`` that names no readable, non-empty file."""
    if environ.get(TOKEN_VAR, "").strip():
        return  # RAY_AUTH_TOKEN wins; the path is not read
    path = environ.get(TOKEN_PATH_VAR, "").strip()
    if not path:
        if environ.get(MODE_VAR, "").strip().lower() == "token" and not token_source(environ):
            raise auth_error(address, environ)
        return
    try:
        ok = bool(Path(path).expanduser().read_text().strip())
        why = "is empty"
    except OSError as e:
        ok, why = False, f"cannot be read ({e.strerror or e})"
    if not ok:
        raise UserError(f"{TOKEN_PATH_VAR} names {path}, which {why}: Ray reads the cluster's authentication token "
                        f"from that file. Point {TOKEN_PATH_VAR} at the file holding the token the cluster's nodes "
                        f"were started with (or unset it, and set {TOKEN_VAR}).", title="ray cluster")


def auth_error(address: str, environ=os.environ) -> UserError:
    """The cluster at ``address`` refused this driver: say what the driver sent and the fix."""
    mode = environ.get(MODE_VAR, "").strip().lower()
    source = token_source(environ)
    if mode != "token":
        sent = (f"this driver sent no token: {MODE_VAR} is {'unset' if not mode else repr(mode)} here, and Ray "
                f"sends a token only with {MODE_VAR}=token")
        if source:
            sent += f" (a token is available from {source}, but unused)"
    elif source:
        sent = f"the cluster rejected the token this driver sent (from {source}): it is not the cluster's token"
    else:
        sent = (f"{MODE_VAR}=token is set but this driver has no token ({TOKEN_VAR}, {TOKEN_PATH_VAR} and "
                f"{DEFAULT_TOKEN_FILE} are all empty or absent)")
    lead = (f"The Ray cluster at {address} requires token authentication and did not accept this driver"
            if source or mode != "token" else f"Cannot join the Ray cluster at {address} with token authentication")
    return UserError(
        f"{lead}: {sent}. "
        f"Run with {MODE_VAR}=token and the token the cluster's nodes were started with, in {TOKEN_VAR} (or in a "
        f"file named by {TOKEN_PATH_VAR}, or {DEFAULT_TOKEN_FILE}); `ray get-auth-token` on the head node prints it. "
        f"See docs/cluster.md, \"Token authentication\".", title="ray cluster")


def gcs_address(address: str) -> str:
    """The GCS ``host:port`` a cluster address names; "" for what a probe cannot check (a Ray
    client ``ray://`` address, or ``auto`` with no address file on this machine)."""
    if address == "auto":
        from ray._common.utils import get_ray_address_file  # noqa: PLC0415 - only when joining

        try:
            address = Path(get_ray_address_file(None)).read_text().strip()
        except OSError:
            return ""
    if "://" in address or ":" not in address:
        return ""
    return address


class _Fd2Captured:
    """Send fd 2 to a temporary file for a moment; on exit restore it and write back every line
    but Ray's own warning about the refused token (the error paragraph says it once)."""

    def __enter__(self):
        self.file = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        kept = [line for line in self.file.read().splitlines(keepends=True)
                if not any(w.encode() in line for w in _RAY_AUTH_WARNING)]
        self.file.close()
        if kept:
            os.write(2, b"".join(kept))
        return False


def check_cluster_accepts_driver(address: str, timeout_s: float) -> None:
    """One GCS request to the cluster at ``address`` with this driver's auth settings; a
    refused or missing token raises ``auth_error``. Anything else (no answer within
    ``timeout_s``, another failure) is left to ``ray.init``, whose own errors say more."""
    gcs = gcs_address(address)
    if not gcs:
        return
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    outcome: dict = {}

    def probe() -> None:
        try:
            GcsClient(address=gcs).internal_kv_get(b"rl-auth-probe", namespace=None, timeout=max(1.0, timeout_s))
            outcome["ok"] = True
        except AuthenticationError:
            outcome["refused"] = True
        except Exception as e:  # unreachable, not a GCS, ...: ray.init reports it
            outcome["other"] = e

    thread = threading.Thread(target=probe, name="rl-ray-auth-probe", daemon=True)
    with _Fd2Captured():
        thread.start()
        thread.join(timeout_s)
    if outcome.get("refused"):
        raise auth_error(address)
