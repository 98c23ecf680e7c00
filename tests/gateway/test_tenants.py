"""Tenants (gateway/tenants.py) and what the gateway lets leak.

- A key file maps API keys to tenants; through the real gateway and decoder one tenant's
  usage.prompt_tokens_details.cached_tokens never counts another tenant's prompt, while every key of one
  tenant shares its cache; a client's cache_salt divides only its own tenant's cache; --shared-cache
  shares it again (the salt rule, checked without a fleet). Images: tests/gateway/test_images.py.
- Error bodies for a dead backend or Redis name the service, never its address nor gRPC's words about the
  connection; /ready without the admin key says ready or not and nothing else.
"""
from __future__ import annotations

import logging
import os

import httpx
import pytest

from gateway.config import GatewayConfig
from gateway.tenants import build_tenants, key_id, read_key_file
from tests.conftest import free_port
from tests.gateway.chat_fleet import MODEL, chat_fleet, wait_idle
from tests.gateway.fleet import GatewayThread, clients

BLOCK = 4
FLAG_KEY = "sk-flag-tenant-key"      # an --api-key key: a tenant of its own
A1, A2, B1 = "sk-acme-tenant-one", "sk-acme-tenant-two", "sk-globex-tenant-one"
KEY_FILE = f"""# key tenant
{A1} acme
{A2}   acme

{B1} globex
"""
SECRET = "The merger closes on Friday at " + "eleven past nine in the blue room " * 6


def key_file(folder, text: str = KEY_FILE, mode: int = 0o600) -> str:
    path = folder / "api_keys"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def test_the_key_file_maps_keys_to_tenants(tmp_path):
    tenants = build_tenants((FLAG_KEY,), key_file(tmp_path))
    assert tenants.keys == (FLAG_KEY, A1, A2, B1)
    assert tenants.names == ("api-key-1", "acme", "acme", "globex")
    flag, a1, a2, b1 = tenants.ids
    assert a1 == a2 and len({flag, a1, b1}) == 3
    assert flag == key_id(FLAG_KEY)   # the response store's name for that key before tenants: still found
    # The salt: one per tenant, divided again by the client's own salt, never equal across tenants.
    assert tenants.salt(1, None) == tenants.salt(2, None) != tenants.salt(3, None)
    assert tenants.salt(1, "x") not in (tenants.salt(1, None), tenants.salt(3, "x"))
    assert tenants.salt(None, "x") == "x" and tenants.salt(None, None) == ""     # no key: the client's salt
    shared = build_tenants((FLAG_KEY,), key_file(tmp_path), shared_cache=True)
    assert shared.salt(1, None) == "" and shared.salt(3, "x") == "x"


@pytest.mark.parametrize("text,message", [
    ("sk-only-a-key\n", "line 1 .* is not 'KEY TENANT'"),
    ("# nothing\n\n", "no 'KEY TENANT' line"),
    (f"{A1} acme\n{B1} bad/name\n", "line 2 .*tenant name"),
    (f"{A1} acme\n{A1} other\n", "each key must be given once"),
    (f"{A1} acme\nsk-15-chars-key globex\n", "line 2 .*at least 16 characters"),
])
def test_a_bad_key_file_is_refused_without_echoing_keys(tmp_path, text, message):
    with pytest.raises(ValueError, match=message) as info:
        GatewayConfig(decoder=("h:1",), api_key_file=key_file(tmp_path, text))
    assert "sk-" not in str(info.value)


def test_keys_shorter_than_16_characters_are_refused_at_start(tmp_path, capsys):
    """--api-key (each of its keys), --api-key-file and --admin-key share MIN_KEY_CHARS: one short key is a
    usage error (exit 2) in one line naming the flag and the minimum, never the key; 16 characters serve."""
    from gateway.config import ENV_PREFIX
    from gateway.tenants import MIN_KEY_CHARS
    from services.common.config import load
    assert MIN_KEY_CHARS == 16
    short, exact = "k" * 15, "k" * 16
    argv = ["--decoder", "h:1"]
    for flags, flag in (([f"--api-key={short}"], "--api-key:"), ([f"--api-key={A1},{short}"], "--api-key:"),
                        (["--api-key-file", key_file(tmp_path, f"{short} acme\n")], "--api-key-file: line 1 of"),
                        ([f"--api-key={A1}", f"--admin-key={short}"], "--admin-key:"),
                        ([f"--admin-key={short}   "], "--admin-key:")):    # counted without its spaces
        with pytest.raises(SystemExit) as refused:
            load((GatewayConfig,), argv + flags, prog="gateway", description="", env_prefix=ENV_PREFIX, environ={})
        assert refused.value.code == 2
        message = capsys.readouterr().err.strip().splitlines()[-1]
        assert flag in message and "a key must be at least 16 characters" in message, message
        assert short not in message.replace(str(tmp_path), "")
    (cfg,) = load((GatewayConfig,), argv + [f"--api-key={exact}", f"--admin-key={'a' * 16}"], prog="gateway",
                  description="", env_prefix=ENV_PREFIX, environ={})
    assert cfg.tenants().keys == (exact,) and cfg.admin_key == "a" * 16
    assert GatewayConfig(decoder=("h:1",), api_key_file=key_file(tmp_path, f"{exact} acme\n")).tenants().keys \
        == (exact,)


def test_the_key_file_is_checked_at_start(tmp_path, caplog):
    with pytest.raises(ValueError, match="cannot read"):
        GatewayConfig(decoder=("h:1",), api_key_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="admin_key must differ"):
        GatewayConfig(decoder=("h:1",), api_key_file=key_file(tmp_path), admin_key=B1)
    with pytest.raises(ValueError, match="each key must be given once"):
        GatewayConfig(decoder=("h:1",), api_key=A1, api_key_file=key_file(tmp_path))
    with caplog.at_level(logging.WARNING, logger="tessera.gateway.tenants"):
        read_key_file(key_file(tmp_path, mode=0o644))
    assert "chmod 600" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tessera.gateway.tenants"):
        read_key_file(key_file(tmp_path))
    assert not caplog.text


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_chat_model):
    folder = tmp_path_factory.mktemp("tenants")
    gateway = {"api_key": FLAG_KEY, "api_key_file": key_file(folder)}
    with chat_fleet(tiny_chat_model, folder, gateway=gateway) as f:   # its decoder: --block-size 4
        yield f


def cached(url: str, key: str, prompt: str = SECRET, salt: str | None = None) -> tuple[int, int]:
    """(cached_tokens, prompt_tokens) of a one-token chat sent with key."""
    with clients(url, key) as c:
        reply = c["client"].chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1, temperature=0,
            extra_body={"cache_salt": salt} if salt else {})
    return reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens


def test_no_tenant_sees_anothers_cached_tokens(fleet):
    url = fleet["url"]
    first, prompt = cached(url, A1)
    full = (prompt - 1) // BLOCK * BLOCK
    assert first < full - BLOCK
    assert cached(url, B1)[0] == 0            # another tenant: not even the chat template's blocks
    assert cached(url, FLAG_KEY)[0] == 0      # an --api-key key is a tenant of its own
    assert cached(url, A2)[0] >= full - BLOCK     # the same tenant's other key hits its blocks
    assert cached(url, B1)[0] >= full - BLOCK     # and the other tenant now hits its own
    # A client's own salt divides its tenant's cache, and the same salt in two tenants shares nothing.
    assert cached(url, A1, salt="team-1")[0] == 0
    assert cached(url, B1, salt="team-1")[0] == 0
    assert cached(url, A2, salt="team-1")[0] >= full - BLOCK
    wait_idle(fleet)


def test_completions_are_salted_too(fleet):
    """The legacy route, echo included, uses the tenant's salt as well."""
    text = "Eleven past nine in the green room, said the ledger. " * 4

    def usage(key: str, **extra) -> int:
        with clients(fleet["url"], key) as c:
            reply = c["http"].post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1,
                                                             "temperature": 0, **extra})
        assert reply.status_code == 200, reply.text
        return (reply.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    usage(A1)
    assert usage(A2) > 0
    assert usage(B1) == 0 and usage(FLAG_KEY, echo=True) == 0
    wait_idle(fleet)


def test_error_bodies_name_no_address_and_ready_says_only_ready(tmp_path):
    dead, redis = free_port(), free_port()
    cfg = GatewayConfig(host="127.0.0.1", port=free_port(), decoder=(f"127.0.0.1:{dead}",), api_key=A1,
                        admin_key="sk-tenants-admin-key", health_timeout_s=0.5, grpc_timeout_s=2,
                        response_store=f"redis://127.0.0.1:{redis}/0")
    with GatewayThread(cfg) as gw, clients(gw.url, A1) as served:
        http = served["http"]
        replies = [http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
                       {"role": "user", "content": "hi"}]}),
                   http.post("/v1/completions", json={"prompt": "hi"}),
                   http.get("/v1/models"),
                   http.get("/v1/responses/resp_123")]     # the store: Redis is not there either
        for reply in replies:
            assert reply.status_code == 503, reply.text
            text = reply.text
            assert "127.0.0.1" not in text and str(dead) not in text and str(redis) not in text, text
            assert "ipv4" not in text and "@" not in text and "Connection refused" not in text, text
        assert "decoder" in replies[0].json()["error"]["message"]
        assert "response store" in replies[3].json()["error"]["message"]
        for headers in ({}, {"Authorization": f"Bearer {A1}"}):
            ready = httpx.get(gw.url + "/ready", headers=headers, timeout=10)
            assert ready.status_code == 503 and ready.json()["status"] == "not_ready", ready.text
            assert "backends" not in ready.json() and "127.0.0.1" not in ready.text and "decoder" not in ready.text
        ready = httpx.get(gw.url + "/ready", headers={"Authorization": "Bearer sk-tenants-admin-key"}, timeout=10)
        assert ready.status_code == 503 and f"decoder@127.0.0.1:{dead}" in ready.json()["backends"], ready.text
