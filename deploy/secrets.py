"""The fleet's secrets, generated where it starts: the backend token every service demands and the gateway
sends (services/common/auth.py), and the Redis password (a `requirepass` config file for redis-server and the
bare password for the vision service's --redis-password-file).

    backend_token    one token, 64 hex characters
    redis_password   the password, 64 hex characters
    redis_conf       `requirepass <password>`: redis-server's first argument

`make up` (deploy/launcher.py) writes fresh ones per fleet into run/secrets, each readable by its owner only.
`make cluster-up` (deploy/cluster/) writes them once into build/cluster/secrets and keeps them; compose mounts
them as secrets at /run/secrets/NAME, so there the files must be readable by the containers' users: the folder
is its owner's alone (0700) and guards them on the host. Kubernetes reads the same three keys from the Secret
`tessera-backend` (docs/operation.md, Security).
"""
from __future__ import annotations

import os
from pathlib import Path

from services.common.auth import new_token

NAMES = ("backend_token", "redis_password", "redis_conf")


def _write(path: Path, text: str, mode: int) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with open(fd, "w", encoding="utf-8") as out:
        out.write(text)
    os.chmod(path, mode)   # the umask may have taken bits off at creation


def ensure(folder: Path, *, fresh: bool, mode: int = 0o600) -> Path:
    """Write the three files into folder (0700) unless all are there and fresh is False; returns folder."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    if fresh or not all((folder / name).is_file() for name in NAMES):
        password = new_token()
        _write(folder / "backend_token", new_token() + "\n", mode)
        _write(folder / "redis_password", password + "\n", mode)
        _write(folder / "redis_conf", f"requirepass {password}\n", mode)
    for name in NAMES:
        (folder / name).chmod(mode)
    return folder


def redis_password(folder: Path) -> str | None:
    """The password in folder/redis_password, or None when there is none."""
    path = folder / "redis_password"
    return path.read_text().strip() if path.is_file() else None
