"""deploy/cluster/compose.py: the compose file read once into the values up, health and status use."""
from __future__ import annotations

import pytest

from deploy.cluster import GATEWAY_URL, ClusterError, ComposeFile
from deploy.cluster.compose import Port
from tests.deploy import topology as topo


@pytest.fixture(scope="module")
def project() -> ComposeFile:
    return ComposeFile.load()


def test_every_service_is_read_with_its_health_check_argv(project):
    raw = topo.load_compose()["services"]
    assert list(project.services) == list(raw)
    for name, svc in raw.items():
        assert project.services[name].health_check == tuple(svc["healthcheck"]["test"][1:]), name


def test_the_built_images_are_the_services_with_a_build_section(project):
    raw = topo.load_compose()["services"]
    want = {svc["image"]: svc["build"]["target"] for svc in raw.values() if "build" in svc}
    assert project.build_targets() == want and want  # decoder-vl shares decoder's image: one build


def test_the_gateway_url_is_the_port_the_compose_file_publishes(project):
    (port,) = project.services["gateway"].ports
    assert GATEWAY_URL == f"http://{port.dial_host}:{port.host_port}"


def test_the_urls_name_every_published_port(project):
    lines = project.urls()
    assert len(lines) == len(project.published_ports())
    assert any(line.split() == ["gateway", "http://127.0.0.1:8000", "(OpenAI", "base_url",
                                "http://127.0.0.1:8000/v1)"] for line in lines)
    assert any(line.split()[:2] == ["redis", "redis://127.0.0.1:6380/0"] for line in lines)


@pytest.mark.parametrize("entry, host, bind, port", [
    ("8000:8000", None, "0.0.0.0", 8000),
    ("127.0.0.1:6380:6380", "127.0.0.1", "127.0.0.1", 6380),
])
def test_a_port_entry_is_read_as_compose_reads_it(entry, host, bind, port):
    parsed = Port.parse("svc", entry)
    assert (parsed.host, parsed.bind_host, parsed.host_port) == (host, bind, port)


@pytest.mark.parametrize("entry", ["8000", "a:b:c:d", "127.0.0.1:http:80", 8000])
def test_a_port_entry_compose_would_not_publish_so_is_one_line(entry):
    with pytest.raises(ClusterError) as bad:
        Port.parse("gateway", entry)
    assert str(bad.value).startswith("gateway: port") and "\n" not in str(bad.value)


def test_a_health_check_not_in_cmd_form_is_refused(tmp_path):
    path = tmp_path / "compose.yml"
    path.write_text("services:\n  web:\n    image: x\n    healthcheck: {test: [CMD-SHELL, 'true']}\n")
    with pytest.raises(ClusterError, match="web: health check CMD-SHELL is not CMD"):
        ComposeFile.load(path)


@pytest.mark.parametrize("service, why", [
    ("web: {healthcheck: {test: [CMD, 'true']}}", "web: no image"),
    ("web: {image: x}", "web: no health check"),
    ("web: plain", "web: no image"),
])
def test_a_service_the_harness_cannot_drive_is_one_line(tmp_path, service, why):
    path = tmp_path / "compose.yml"
    path.write_text(f"services:\n  {service}\n")
    with pytest.raises(ClusterError) as bad:
        ComposeFile.load(path)
    assert str(bad.value).startswith(why) and "\n" not in str(bad.value)


@pytest.mark.parametrize("text", ["services: [", "just a string\n", "volumes: {}\n"])
def test_a_file_that_is_not_compose_is_one_line(tmp_path, text):
    path = tmp_path / "compose.yml"
    path.write_text(text)
    with pytest.raises(ClusterError) as bad:
        ComposeFile.load(path)
    assert "not a compose file with services" in str(bad.value) and "\n" not in str(bad.value)
