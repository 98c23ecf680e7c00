"""Setting this host up for podman: the only code here that installs packages or writes as root.

What podman (Debian's 4.3.1) needs, each step skipped when already done:
- apt-get install: podman, buildah, mmdebstrap, uidmap, runc, and the CNI dnsname plugin (Debian's podman 4.3
  uses CNI networks, which resolve service names only with it).
- /etc/containers/containers.conf: the runc runtime and default ulimits the host allows (`ulimit -Hn`);
  without them every container fails (crun: "cgroups in hybrid mode not supported", setrlimit EPERM).
  An existing file that tessera did not write is left alone.
- podman-compose==1.6.0 in its own venv (build/cluster/compose-venv), not in the project's .venv.
"""
from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

from .commands import ClusterError, EngineUnavailable, log, run
from .config import NO_INSTALL, ClusterSettings
from .paths import WORK

# golang-...-dnsname: DNS by service name on podman's CNI networks (Debian's podman 4.3 uses CNI); without it
# the gateway cannot resolve `decoder:50052`.
APT_PACKAGES = ("podman", "buildah", "mmdebstrap", "uidmap", "runc", "golang-github-containernetworking-plugin-dnsname")
PODMAN_COMPOSE = "podman-compose==1.6.0"
COMPOSE_VENV = WORK / "compose-venv"
COMPOSE_EXE = COMPOSE_VENV / "bin" / "podman-compose"
CONTAINERS_CONF = Path("/etc/containers/containers.conf")
# The first words of a containers.conf this harness wrote; a file written when the harness was a single
# deploy/cluster.py starts with the same words, so it is still recognised as ours and brought up to date.
CONF_MARK = "# Written by tessera's deploy/cluster"


def may_install(settings: ClusterSettings) -> tuple[bool, str]:
    """(whether apt-get may install here, why not when it may not)."""
    if settings.no_install:
        return False, f"{NO_INSTALL} is set"
    if os.geteuid() != 0:
        return False, "not root, so podman cannot be installed with apt-get"
    if shutil.which("apt-get") is None:
        return False, "no apt-get to install podman with"
    return True, ""


def missing_packages() -> list[str]:
    """The APT_PACKAGES dpkg does not report installed (all of them where there is no dpkg)."""
    if shutil.which("dpkg-query") is None:
        return list(APT_PACKAGES)
    done = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${db:Status-Status}\n", *APT_PACKAGES],
                          capture_output=True, text=True)
    installed = {line.split()[0] for line in done.stdout.splitlines() if line.endswith(" installed")}
    return [p for p in APT_PACKAGES if p not in installed]


def install_packages(packages: list[str]) -> None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "update", "-q"], env=env, capture=True)
    run(["apt-get", "install", "-y", "-q", *packages], env=env, capture=True)


def containers_conf_text() -> str:
    """The runtime and ulimits podman must use here: the file limit is the host's hard limit (`ulimit -Hn`)."""
    def hard(which: int, ceiling: int) -> int:
        limit = resource.getrlimit(which)[1]
        return ceiling if limit == resource.RLIM_INFINITY else min(limit, ceiling)
    nofile, nproc = hard(resource.RLIMIT_NOFILE, 1048576), hard(resource.RLIMIT_NPROC, 32768)
    return (f"{CONF_MARK} (make cluster-up): podman as root where crun cannot set\n"
            "# rlimits or drive hybrid cgroups. Delete it to go back to podman's defaults.\n"
            "[containers]\n"
            f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n\n'
            "[engine]\n"
            'runtime = "runc"\n')


def configure_podman() -> None:
    text = containers_conf_text()
    if CONTAINERS_CONF.exists():
        current = CONTAINERS_CONF.read_text()
        if current == text:
            return
        if not current.startswith(CONF_MARK):
            log(f"{CONTAINERS_CONF} exists and tessera did not write it: left as is (it needs runtime=\"runc\" "
                "and default_ulimits within `ulimit -Hn` where crun fails)")
            return
    if os.geteuid() != 0:
        log(f"not root: cannot write {CONTAINERS_CONF}; containers may fail to start")
        return
    CONTAINERS_CONF.parent.mkdir(parents=True, exist_ok=True)
    CONTAINERS_CONF.write_text(text)
    log(f"wrote {CONTAINERS_CONF}")


def podman_compose() -> list[str]:
    """podman-compose at the pinned version, in its own venv; the command that runs it."""
    want = PODMAN_COMPOSE.split("==")[1]
    if COMPOSE_EXE.exists():
        done = subprocess.run([str(COMPOSE_EXE), "--version"], capture_output=True, text=True)
        if want in done.stdout + done.stderr:
            return [str(COMPOSE_EXE)]
    if not (COMPOSE_VENV / "bin" / "python").exists():
        run(["python3" if shutil.which("python3") else sys.executable, "-m", "venv", str(COMPOSE_VENV)])
    run([str(COMPOSE_VENV / "bin" / "python"), "-m", "pip", "install", "-q", PODMAN_COMPOSE])
    return [str(COMPOSE_EXE)]


def prepare_host(install: bool, settings: ClusterSettings) -> list[str]:
    """podman, the packages beside it and its configuration, installed where allowed; the podman-compose
    command. Raises EngineUnavailable (one line) where podman cannot be had."""
    allowed, why = may_install(settings)
    if shutil.which("podman") is None:
        if not (install and allowed):
            raise EngineUnavailable(f"no container engine: no running Docker daemon and no podman "
                                    f"({why or 'installing was not allowed (--no-install)'})")
        try:
            install_packages(missing_packages())
        except ClusterError as exc:
            raise EngineUnavailable(f"no container engine: apt-get could not install podman "
                                    f"({str(exc).splitlines()[0]})") from exc
        if shutil.which("podman") is None:
            raise EngineUnavailable("no container engine: apt-get installed no podman")
    missing = missing_packages()
    if missing and install and allowed:
        install_packages(missing)
    elif missing:
        log(f"not installed, and not installing: {missing} (image builds or DNS by service name may fail)")
    configure_podman()
    try:
        return podman_compose()
    except ClusterError as exc:
        raise EngineUnavailable(f"podman is here but {PODMAN_COMPOSE} could not be installed "
                                f"({str(exc).splitlines()[0]})") from exc
