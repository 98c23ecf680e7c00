"""Tenants: who an API key belongs to, and the cache salt that keeps each tenant's cache hits its own.

A tenant is a set of API keys. Keys come from --api-key (comma-separated; each key is a tenant of its own) and
from --api-key-file, a text file of `KEY TENANT` lines (several keys may name one tenant, e.g. an old and a new
key during rotation; `#` starts a comment line; blank lines are skipped). The file holds secrets: it should be
readable by its owner only (0600), and a warning says so at start when it is not.

What a tenant isolates (unless --shared-cache): the decoder's prefix cache and the vision service's
image-feature cache. Both report their hits to the caller (usage.prompt_tokens_details.cached_tokens,
cached_images), and a hit is also faster, so a shared cache tells one tenant whether another sent the same
prompt or image. The gateway therefore sends every decoder and vision call a salt that digests the tenant
(and the client's own cache_salt, if any): different salts share no KV block and no cached image rows. The
cost: nothing cached is shared across tenants; each tenant's first sight of a prompt prefix or an image is
computed and stored again. With no API key at all the gateway has one tenant and nothing is salted but a
client's own cache_salt, as with --shared-cache.
"""
from __future__ import annotations

import hashlib
import logging
import re
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tessera.gateway.tenants")

# A tenant name as the key file spells it: plain, so it is safe in logs and cannot contain the separator
# of the salt's digest input.
TENANT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# The salt's form (the decoder takes any string; this one is recognisable in its logs).
SALT_PREFIX = "tenant-"
# The shortest API or admin key accepted (--api-key, each --api-key-file key, --admin-key): a client may try
# keys as fast as the gateway answers, so a short one is guessable. secrets.token_hex(8) is 16 characters;
# the deployments' examples use token_hex(32). The backend token's own bound: services/common/auth.py.
MIN_KEY_CHARS = 16


def check_key(key: str, where: str) -> None:
    """A ValueError naming where (a flag, or a key file's line) and MIN_KEY_CHARS when key is shorter; the key
    itself is never echoed."""
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"{where}: a key must be at least {MIN_KEY_CHARS} characters (e.g. python -c 'import "
                         "secrets; print(secrets.token_hex(32))')")


@dataclass(frozen=True)
class Tenants:
    """The accepted API keys and whose each is. keys[i] belongs to the tenant whose id is ids[i]; the edge
    puts i in the request's scope state (`key_index`)."""

    keys: tuple[str, ...]
    names: tuple[str, ...]   # the tenant of each key, for logs: its key-file name, or "api-key-<i>"
    ids: tuple[str, ...]     # the tenant of each key as a stable digest (32 hex characters)
    shared_cache: bool = False

    def id_of(self, key_index: int | None) -> str | None:
        """The tenant id of key_index; None without authentication."""
        return None if key_index is None else self.ids[key_index]

    def salt(self, key_index: int | None, client_salt: str | None) -> str:
        """The cache salt sent to the backends (empty: unsalted). Per tenant unless the cache is shared or
        there are no keys; a client's own cache_salt further divides its tenant's cache."""
        if key_index is None or self.shared_cache:
            return client_salt or ""
        h = hashlib.blake2b(digest_size=16, person=b"tessera-salt")
        h.update(self.ids[key_index].encode())
        h.update(b"\x00")   # ids are hex, so this separator makes (tenant, client salt) -> salt one-to-one
        h.update((client_salt or "").encode())
        return SALT_PREFIX + h.hexdigest()


def cache_salt(request, client_salt: str | None = None) -> str:
    """The cache salt of every decoder and vision call an HTTP request (a starlette Request) makes: its
    tenant's, combined with the client's own cache_salt."""
    tenants: Tenants = request.app.state.tenants
    return tenants.salt(getattr(request.state, "key_index", None), client_salt)


def key_id(key: str) -> str:
    """The tenant id of a key that is its own tenant (--api-key): the response store's name for a key before
    tenants existed (gateway/response_store.py), so stored responses stay reachable."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def name_id(name: str) -> str:
    """The tenant id of a key-file tenant name (never equal to a key's: the input is prefixed)."""
    return hashlib.sha256(b"tenant\x00" + name.encode()).hexdigest()[:32]


def read_key_file(path: str, quiet: bool = False) -> list[tuple[str, str]]:
    """[(key, tenant name)] from a key file, in file order; ValueError naming the line on anything else.
    quiet: no warning about the file's mode (the config's check at load; the app's read warns)."""
    try:
        file = Path(path)
        text = file.read_text(encoding="utf-8")
        mode = file.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file: cannot read {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO) and not quiet:
        log.warning("--api-key-file %s is readable by others than its owner (mode %o); it holds secrets: chmod "
                    "600 it", path, stat.S_IMODE(mode))
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        # The key is never echoed: the message names the line only.
        if len(fields) != 2:
            raise ValueError(f"--api-key-file: line {number} of {path!r} is not 'KEY TENANT'")
        if not TENANT_NAME.match(fields[1]):
            raise ValueError(f"--api-key-file: line {number} of {path!r}: a tenant name is 1-64 of A-Z a-z 0-9 . _ -")
        check_key(fields[0], f"--api-key-file: line {number} of {path!r}")
        pairs.append((fields[0], fields[1]))
    if not pairs:
        raise ValueError(f"--api-key-file: {path!r} has no 'KEY TENANT' line")
    return pairs


def build_tenants(flag_keys: tuple[str, ...], key_file: str | None, shared_cache: bool = False,
                  quiet: bool = False) -> Tenants:
    """The keys of --api-key (each its own tenant) followed by those of --api-key-file (read_key_file); a key
    shorter than MIN_KEY_CHARS is a ValueError."""
    keys, names, ids = [], [], []
    for i, key in enumerate(flag_keys):
        check_key(key, "--api-key")
        keys.append(key)
        names.append(f"api-key-{i + 1}")
        ids.append(key_id(key))
    for key, name in read_key_file(key_file, quiet) if key_file else ():
        keys.append(key)
        names.append(name)
        ids.append(name_id(name))
    if len(set(keys)) != len(keys):
        raise ValueError("api_key, api_key_file: each key must be given once")
    return Tenants(tuple(keys), tuple(names), tuple(ids), shared_cache)
