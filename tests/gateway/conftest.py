"""What the gateway test modules share: the model fixtures, a default fleet, and the clients tests drive it by.

Every fleet (the servers a module starts) yields a dict with at least "url", "client" (openai) and "http"
(httpx), made by tests/gateway/fleet.py's `clients`; `client` and `http` below hand those to the tests.
`fleet` here is the tiny chat fleet (tests/gateway/chat_fleet.py); a module that needs other servers
defines its own `fleet`, which takes precedence in that module.
"""
from __future__ import annotations

import pytest

from tests.decoder.server.conftest import tiny_chat_model  # noqa: F401 - the fixture, shared with the decoder
from tests.gateway.chat_fleet import chat_fleet
from tests.gateway.tool_model import tool_chat_model  # noqa: F401 - the fixture


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_chat_model):  # noqa: F811 - pytest injects the imported fixture
    """One decoder on the tiny chat model behind a gateway, for this module."""
    with chat_fleet(tiny_chat_model, tmp_path_factory.mktemp("chat")) as f:
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    return fleet["client"]


@pytest.fixture(scope="module")
def http(fleet):
    return fleet["http"]
