"""`make cluster-up` / `make cluster-down`: deploy/docker-compose.yml in real containers, on this machine.

    python -m deploy.cluster up [--no-install] [--timeout S]   # prepare, build, start, wait healthy, print URLs
    python -m deploy.cluster down                             # remove it all; fail if anything is left
    python -m deploy.cluster status                           # each service's health, by the compose check

The engine is whichever is present: Docker with `docker compose` (a running daemon), else podman with
podman-compose. Where neither is, `up` installs podman when it may (root and apt-get; `--no-install` or
TESSERA_CLUSTER_NO_INSTALL=1 forbids it) and otherwise stops with one line saying why (exit 3).

What podman (Debian's 4.3.1) needs here, and `up` prepares once, each step skipped when already done:
- apt-get install: podman, buildah, mmdebstrap, uidmap, runc, and the CNI dnsname plugin (Debian's podman 4.3
  uses CNI networks, which resolve service names only with it).
- /etc/containers/containers.conf: the runc runtime and default ulimits the host allows (`ulimit -Hn`);
  without them every container fails (crun: "cgroups in hybrid mode not supported", setrlimit EPERM).
  An existing file that tessera did not write is left alone.
- podman-compose==1.6.0 in its own venv (build/cluster/compose-venv), not in the project's .venv.
- The base images, since no image registry may be reachable: a Debian bookworm root filesystem made by
  mmdebstrap from the host's own apt sources and `podman import`ed (localhost/tessera-python:bookworm),
  and Redis on that base plus Debian's redis-server (deploy/redis.Containerfile).
- A wheelhouse, build/wheels: `pip download` with the host's pip (its index, proxy and certificate
  configuration stay on the host), torch==2.13.0 pinned first, then checked by the image's own pip offline
  (complete_wheelhouse). The Dockerfile installs from it offline (--build-arg WHEELS=local --build-context
  wheels=build/wheels); on a Docker host it installs from the indexes, as always.
- deploy/compose.podman.yml on top of the compose file: podman's choices, so that the main file stays valid
  for Docker Compose (see that file).

podman 4.3 runs no health checks by itself and podman-compose skips `condition: service_healthy` on it, so
`up` waits by running each service's own compose health check inside its container, for every engine.
Every phase prints its time, and build/cluster/timings.json keeps the last run's; build and compose output
goes to build/cluster/logs/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
PODMAN_OVERRIDE = DEPLOY / "compose.podman.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
IGNOREFILE = DEPLOY / "Dockerfile.dockerignore"
REDIS_CONTAINERFILE = DEPLOY / "redis.Containerfile"
WORK = ROOT / "build" / "cluster"
LOGS = WORK / "logs"  # build and compose output, one file per kind, appended per run
COMPOSE_LOG = LOGS / "compose.log"
WHEELS = ROOT / "build" / "wheels"
MODELS = ROOT / "models"
PROJECT = "tessera"

BASE_IMAGE = "localhost/tessera-python:bookworm"
REDIS_IMAGE = "localhost/tessera-redis:bookworm"
SUITE = "bookworm"  # python3 is 3.11 there, as in python:3.11-slim-bookworm and on the host the wheels come from
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates", "make")
# golang-...-dnsname: DNS by service name on podman's CNI networks (Debian's podman 4.3 uses CNI); without it
# the gateway cannot resolve `decoder:50052`.
APT_PACKAGES = ("podman", "buildah", "mmdebstrap", "uidmap", "runc", "golang-github-containernetworking-plugin-dnsname")
PODMAN_COMPOSE = "podman-compose==1.6.0"
COMPOSE_VENV = WORK / "compose-venv"
CONTAINERS_CONF = Path("/etc/containers/containers.conf")
CONF_MARK = "# Written by tessera's deploy/cluster.py"
TORCH = "torch==2.13.0"  # the same pin as `make install`: a looser one pulls a multi-GB CUDA build

NOT_AVAILABLE = 3  # exit status when no engine can be had here


class EngineUnavailable(RuntimeError):
    """No container engine here, and none may be installed; the message is one line saying why."""


class ClusterError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[cluster] {msg}", flush=True)


def run(cmd: list[str], *, check: bool = True, capture: bool = False, env: dict | None = None,
        cwd: Path = ROOT, timeout: float | None = None, quiet: bool = False,
        log_file: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command. log_file: its output goes there (appended), not to the terminal; a failure quotes its end."""
    if not quiet:
        log("$ " + " ".join(cmd) + (f"  (output: {log_file.relative_to(ROOT)})" if log_file else ""))
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with log_file.open("a") as out:
            out.write(f"\n$ {' '.join(cmd)}\n")
            out.flush()
            done = subprocess.run(cmd, cwd=cwd, env=env, text=True, timeout=timeout, stdout=out,
                                  stderr=subprocess.STDOUT)
        if check and done.returncode != 0:
            tail = "\n".join(log_file.read_text().splitlines()[-40:])
            raise ClusterError(f"{' '.join(cmd[:4])}... exited {done.returncode}; the end of {log_file}:\n{tail}")
        return done
    done = subprocess.run(cmd, cwd=cwd, env=env, text=True, timeout=timeout,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    if check and done.returncode != 0:
        detail = f"\n{done.stdout or ''}{done.stderr or ''}".rstrip() if capture else ""
        raise ClusterError(f"{' '.join(cmd[:4])}... exited {done.returncode}{detail}")
    return done


class Timings:
    """Seconds per phase, printed as they end and saved to build/cluster/timings.json."""

    def __init__(self):
        self.phases: dict[str, float] = {}

    def __call__(self, name: str):
        timings = self

        class Phase:
            def __enter__(self):
                self.started = time.monotonic()

            def __exit__(self, *exc):
                took = time.monotonic() - self.started
                timings.phases[name] = round(took, 1)
                log(f"== {name}: {took:.1f}s")
                return False

        return Phase()

    def save(self, engine: str) -> None:
        WORK.mkdir(parents=True, exist_ok=True)
        (WORK / "timings.json").write_text(json.dumps({"engine": engine, "phases": self.phases}, indent=1) + "\n")


@dataclass
class Engine:
    """A container CLI and the compose command that drives the project with it."""

    name: str                      # "docker" | "podman"
    compose_cmd: list[str]         # ... -f FILES; append a subcommand
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))

    @property
    def cli(self) -> str:
        return self.name

    def compose(self, *args: str, check: bool = True, timeout: float | None = None):
        """A compose subcommand; its output goes to build/cluster/logs/compose.log (podman 4.3 prints a systemd
        error per health check it cannot schedule: noise, since deploy/cluster.py runs the checks itself)."""
        return run([*self.compose_cmd, *args], check=check, env=self.env, timeout=timeout, log_file=COMPOSE_LOG)

    def __call__(self, *args: str, check: bool = True, capture: bool = True, quiet: bool = True,
                 timeout: float | None = 120):
        return run([self.cli, *args], check=check, capture=capture, env=self.env, timeout=timeout, quiet=quiet)

    @property
    def project_label(self) -> str:
        return f"com.docker.compose.project={PROJECT}"

    def container(self, service: str, *, running: bool = False) -> str | None:
        """The id of the service's container (the newest), by the labels both compose tools set."""
        args = ["ps", "-q"] + ([] if running else ["-a"])
        done = self(*args, "--filter", f"label={self.project_label}",
                    "--filter", f"label=com.docker.compose.service={service}")
        ids = done.stdout.split()
        return ids[0] if ids else None

    def state(self, service: str) -> str:
        cid = self.container(service)
        if cid is None:
            return "absent"
        return self("inspect", "--format", "{{.State.Status}}", cid, check=False).stdout.strip() or "absent"

    def logs(self, service: str, lines: int = 30) -> str:
        cid = self.container(service)
        if cid is None:
            return "(no container)"
        done = self("logs", "--tail", str(lines), cid, check=False)
        return (done.stdout + done.stderr).strip()

    def leftovers(self) -> list[str]:
        """Every container, pod, network and volume of the project still there (empty after `down`)."""
        found = []
        label = ["--filter", f"label={self.project_label}"]
        found += [f"container {c}" for c in self("ps", "-a", "-q", *label).stdout.split()]
        if self.name == "podman":
            found += [f"container {c}" for c in self("ps", "-a", "-q", "--filter",
                                                     f"label=io.podman.compose.project={PROJECT}").stdout.split()
                      if f"container {c}" not in found]
            pods = self("pod", "ps", "--format", "{{.Name}}").stdout.split()
            found += [f"pod {p}" for p in pods if p in (f"pod_{PROJECT}", PROJECT)]
        networks = self("network", "ls", "--format", "{{.Name}}").stdout.split()
        found += [f"network {n}" for n in networks if n.startswith((f"{PROJECT}_", f"{PROJECT}-"))]
        volumes = set(self("volume", "ls", "-q", *label).stdout.split())
        prefixes = (f"{PROJECT}_", f"{PROJECT}-")
        volumes |= {v for v in self("volume", "ls", "-q").stdout.split() if v.startswith(prefixes)}
        found += [f"volume {v}" for v in sorted(volumes)]
        return found


# -- finding or installing an engine -------------------------------------------------------------------------

def docker_engine() -> Engine | None:
    """Docker, when its daemon answers and the compose plugin is there (a client alone is not an engine)."""
    if shutil.which("docker") is None:
        return None
    for probe in (["docker", "info", "--format", "{{.ServerVersion}}"], ["docker", "compose", "version"]):
        try:
            if subprocess.run(probe, capture_output=True, timeout=20).returncode != 0:
                return None
        except (OSError, subprocess.TimeoutExpired):
            return None
    return Engine("docker", ["docker", "compose", "-p", PROJECT, "-f", str(COMPOSE)])


def may_install() -> tuple[bool, str]:
    if os.environ.get("TESSERA_CLUSTER_NO_INSTALL"):
        return False, "TESSERA_CLUSTER_NO_INSTALL is set"
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


def install_podman(packages: list[str]) -> None:
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
    exe = COMPOSE_VENV / "bin" / "podman-compose"
    want = PODMAN_COMPOSE.split("==")[1]
    if exe.exists():
        done = subprocess.run([str(exe), "--version"], capture_output=True, text=True)
        if want in done.stdout + done.stderr:
            return [str(exe)]
    if not (COMPOSE_VENV / "bin" / "python").exists():
        run(["python3" if shutil.which("python3") else sys.executable, "-m", "venv", str(COMPOSE_VENV)])
    run([str(COMPOSE_VENV / "bin" / "python"), "-m", "pip", "install", "-q", PODMAN_COMPOSE])
    return [str(exe)]


def podman_engine(install: bool) -> Engine:
    if shutil.which("podman") is None:
        allowed, why = may_install()
        if not (install and allowed):
            raise EngineUnavailable(f"no container engine: no running Docker daemon and no podman "
                                    f"({why or 'installing was not allowed (--no-install)'})")
        try:
            install_podman(missing_packages())
        except ClusterError as exc:
            raise EngineUnavailable(f"no container engine: apt-get could not install podman "
                                    f"({str(exc).splitlines()[0]})") from exc
        if shutil.which("podman") is None:
            raise EngineUnavailable("no container engine: apt-get installed no podman")
    missing = missing_packages()
    if missing and install and may_install()[0]:
        install_podman(missing)
    elif missing:
        log(f"not installed, and not installing: {missing} (image builds or DNS by service name may fail)")
    configure_podman()
    try:
        compose = podman_compose()
    except ClusterError as exc:
        raise EngineUnavailable(f"podman is here but {PODMAN_COMPOSE} could not be installed "
                                f"({str(exc).splitlines()[0]})") from exc
    # -p: the project name the labels carry; the override holds podman's choices (deploy/compose.podman.yml).
    return Engine("podman", [*compose, "-p", PROJECT, "-f", str(COMPOSE), "-f", str(PODMAN_OVERRIDE)])


def find_engine(install: bool = True) -> Engine:
    """Docker with compose when a daemon runs, else podman (installed where allowed)."""
    if os.environ.get("TESSERA_CLUSTER_ENGINE") != "podman":
        engine = docker_engine()
        if engine is not None:
            return engine
    return podman_engine(install)


def engine_if_present() -> Engine | None:
    """The engine, without installing or configuring anything (for down and status)."""
    engine = docker_engine() if os.environ.get("TESSERA_CLUSTER_ENGINE") != "podman" else None
    if engine is None and shutil.which("podman") and (COMPOSE_VENV / "bin" / "podman-compose").exists():
        engine = Engine("podman", [str(COMPOSE_VENV / "bin" / "podman-compose"), "-p", PROJECT, "-f", str(COMPOSE),
                                   "-f", str(PODMAN_OVERRIDE)])
    return engine


# -- images ----------------------------------------------------------------------------------------------------

def apt_sources() -> list[str]:
    """The host's apt source files that name the base's suite, found the way apt finds them."""
    done = subprocess.run(["apt-config", "shell", "SL", "Dir::Etc::sourcelist/f", "SP", "Dir::Etc::sourceparts/d"],
                          capture_output=True, text=True)
    values = dict(line.split("=", 1) for line in done.stdout.split() if "=" in line)
    sourcelist = Path(values.get("SL", "'/etc/apt/sources.list'").strip("'"))
    parts = Path(values.get("SP", "'/etc/apt/sources.list.d/'").strip("'"))
    files = [sourcelist] + sorted(p for p in parts.glob("*") if p.suffix in (".list", ".sources"))
    chosen = []
    for path in files:
        try:
            lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
        except OSError:
            continue
        if any(SUITE in line for line in lines):
            chosen.append(str(path))
    if not chosen:
        raise ClusterError(f"no apt source on this host names {SUITE}: cannot build the base image")
    return chosen


def image_exists(engine: Engine, image: str) -> bool:
    return engine("image", "exists", image, check=False).returncode == 0


def build_base_image(engine: Engine) -> None:
    """Debian bookworm with python3, venv and make, from the host's apt sources, imported as BASE_IMAGE."""
    if image_exists(engine, BASE_IMAGE):
        log(f"{BASE_IMAGE}: already there")
        return
    WORK.mkdir(parents=True, exist_ok=True)
    rootfs = WORK / "rootfs.tar"
    rootfs.unlink(missing_ok=True)
    try:
        # Check-Valid-Until off: a snapshot mirror's Release files may carry an expired date.
        run(["mmdebstrap", "--variant=apt", "--include=" + ",".join(BASE_PACKAGES),
             "--aptopt=Acquire::Check-Valid-Until \"false\"", SUITE, str(rootfs), *apt_sources()],
            log_file=LOGS / "base-image.log")
        engine("import", "--change", 'CMD ["/bin/bash"]', str(rootfs), BASE_IMAGE, timeout=600)
    finally:
        rootfs.unlink(missing_ok=True)


def build_redis_image(engine: Engine) -> None:
    if image_exists(engine, REDIS_IMAGE):
        log(f"{REDIS_IMAGE}: already there")
        return
    run([engine.cli, "build", "-f", str(REDIS_CONTAINERFILE), "--build-arg", f"BASE={BASE_IMAGE}",
         "-t", REDIS_IMAGE, str(DEPLOY)], env=engine.env, log_file=LOGS / "build.log")


def image_python(engine: Engine, image: str) -> str:
    """The full Python version inside an image (3.11.2 on bookworm): markers such as
    `python_full_version < "3.11.3"` (redis needs async-timeout there) must be judged for it, not the host."""
    done = engine("run", "--rm", image, "python3", "-c", "import platform; print(platform.python_version())")
    return done.stdout.strip()


def wheelhouse_key(python: str) -> str:
    return "\n".join([TORCH, python, (ROOT / "requirements.txt").read_text(), (ROOT / "constraints.txt").read_text()])


def prepare_wheelhouse(engine: Engine | None, python: str, image: str | None) -> None:
    """build/wheels for an offline image build: the host's pip, with the host's index and TLS configuration,
    resolving for the image's Python (binary wheels only, as an offline build cannot compile); then the
    image's own pip checks it (complete_wheelhouse). A stamp keeps a second run to a look."""
    stamp = WORK / "wheels.stamp"  # not inside build/wheels: that folder is a build context
    if stamp.exists() and stamp.read_text() == wheelhouse_key(python):
        log(f"{WHEELS.relative_to(ROOT)}: already there (Python {python})")
        return
    WHEELS.mkdir(parents=True, exist_ok=True)
    # torch first and pinned in the same resolve, so nothing else may pull a CUDA build.
    run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--python-version", python,
         "--only-binary=:all:", TORCH, "-r", "requirements.txt", "-c", "constraints.txt", "-d", str(WHEELS)],
        log_file=LOGS / "wheels.log")
    if engine is not None and image is not None:
        complete_wheelhouse(engine, image)
    stamp.write_text(wheelhouse_key(python))


def complete_wheelhouse(engine: Engine, image: str) -> None:
    """Ask the image's own pip, offline, whether the wheelhouse satisfies everything; fetch what it names.

    The host's pip judges environment markers for the host's interpreter, so a dependency the image's Python
    needs and the host's does not (`async-timeout; python_full_version < "3.11.3"`, from redis) is missing.
    A dry run inside the image names it; the host's pip downloads it; repeat until the dry run passes."""
    mounts = ["-v", f"{WHEELS}:/wheels:ro", "-v", f"{ROOT / 'requirements.txt'}:/req/requirements.txt:ro",
              "-v", f"{ROOT / 'constraints.txt'}:/req/constraints.txt:ro"]
    script = ("python -m venv /tmp/venv && /tmp/venv/bin/pip install -q --disable-pip-version-check --dry-run "
              f"--no-index --find-links /wheels {TORCH} -r /req/requirements.txt -c /req/constraints.txt")
    for _ in range(20):
        done = engine("run", "--rm", *mounts, image, "sh", "-c", script, check=False, timeout=600)
        if done.returncode == 0:
            return
        missing = re.findall(r"No matching distribution found for ([^\s;]+)", done.stdout + done.stderr)
        if not missing:
            raise ClusterError(f"the wheelhouse does not satisfy the image's pip:\n{done.stdout}{done.stderr}")
        log(f"the image's Python also needs {missing}: downloading")
        run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--only-binary=:all:",
             *missing, "-c", "constraints.txt", "-d", str(WHEELS)], log_file=LOGS / "wheels.log")
    raise ClusterError("the wheelhouse is still incomplete after 20 rounds")


def service_targets() -> dict[str, str]:
    """image -> Dockerfile target, for every compose service that is built."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return {svc["image"]: svc["build"]["target"] for svc in services.values() if "build" in svc}


def build_images(engine: Engine, offline_wheels: bool) -> None:
    args = ["build", "-f", str(DOCKERFILE)]
    if engine.name == "podman":
        # buildah reads no Dockerfile.dockerignore beside the Dockerfile: name it, or .venv and models/ go in.
        args += ["--ignorefile", str(IGNOREFILE), "--build-arg", f"PYTHON_IMAGE={BASE_IMAGE}"]
    if offline_wheels:
        args += ["--build-arg", "WHEELS=local", "--build-context", f"wheels={WHEELS}"]
    for image, target in service_targets().items():
        with_cache = time.monotonic()
        run([engine.cli, *args, "--target", target, "-t", image, str(ROOT)], env=engine.env,
            log_file=LOGS / "build.log")
        log(f"{image} (target {target}) built in {time.monotonic() - with_cache:.1f}s")
    # The images these tags replaced, now untagged: only ours (the label), never another project's.
    engine("image", "prune", "-f", "--filter", "label=tessera.project=tessera", check=False, timeout=300)


# -- health ----------------------------------------------------------------------------------------------------

def health_checks() -> dict[str, list[str]]:
    """service -> the argv of its compose health check (the CMD form every service uses)."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    checks = {}
    for name, svc in services.items():
        test = svc["healthcheck"]["test"]
        if test[0] != "CMD":
            raise ClusterError(f"{name}: health check {test[0]} is not CMD")
        checks[name] = list(test[1:])
    return checks


def check_once(engine: Engine, service: str, argv: list[str]) -> tuple[bool, str]:
    cid = engine.container(service, running=True)
    if cid is None:
        return False, engine.state(service)
    done = engine("exec", cid, *argv, check=False, timeout=30)
    return done.returncode == 0, (done.stdout + done.stderr).strip().splitlines()[-1:] and \
        (done.stdout + done.stderr).strip().splitlines()[-1] or f"exit {done.returncode}"


def wait_healthy(engine: Engine, timeout: float, services: list[str] | None = None) -> dict[str, float]:
    """Poll every service's own health check inside its container until all pass; seconds each took."""
    checks = health_checks()
    pending = dict.fromkeys(services or list(checks))
    started = time.monotonic()
    took: dict[str, float] = {}
    while pending:
        for name in list(pending):
            ok, seen = check_once(engine, name, checks[name])
            if ok:
                took[name] = round(time.monotonic() - started, 1)
                log(f"{name}: healthy after {took[name]}s")
                del pending[name]
                continue
            state = engine.state(name)
            if state in ("exited", "dead", "absent", "stopped"):
                raise ClusterError(f"{name} is {state}, not starting; its last lines:\n{engine.logs(name)}")
            pending[name] = seen
        if pending and time.monotonic() - started > timeout:
            detail = "\n".join(f"  {n}: {s}\n{engine.logs(n, 10)}" for n, s in pending.items())
            raise ClusterError(f"not healthy after {timeout:.0f}s:\n{detail}")
        if pending:
            time.sleep(1)
    return took


def urls() -> list[str]:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    out = []
    for name, svc in services.items():
        for port in svc.get("ports", []):
            host_part = port.rsplit(":", 1)[0]
            host, _, host_port = host_part.rpartition(":")
            host = host or "127.0.0.1"
            if name == "gateway":
                out.append(f"  {name:<10} http://{host}:{host_port} (OpenAI base_url http://{host}:{host_port}/v1)")
            elif name == "redis":
                out.append(f"  {name:<10} redis://{host}:{host_port}/0")
            else:
                out.append(f"  {name:<10} {host}:{host_port} (gRPC)")
    return out


GATEWAY_URL = "http://127.0.0.1:8000"


def published_ports() -> list[tuple[str, str, int]]:
    """(service, host address, host port) for every port the compose file publishes."""
    out = []
    for name, svc in yaml.safe_load(COMPOSE.read_text())["services"].items():
        for port in svc.get("ports", []):
            host, _, host_port = port.rsplit(":", 1)[0].rpartition(":")
            out.append((name, host or "0.0.0.0", int(host_port)))
    return out


def busy_ports() -> list[str]:
    busy = []
    for name, host, port in published_ports():
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                busy.append(f"{name} {host}:{port}")
    return busy


def wait_ports_free(timeout: float = 60) -> None:
    """The published ports must be free on the host. 50051-50054 lie in Linux's ephemeral range, so another
    program's connection or test server may hold one for a moment: wait for it, then say who holds it."""
    deadline = time.monotonic() + timeout
    while busy := busy_ports():
        if time.monotonic() > deadline:
            holders = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout if shutil.which("ss") \
                else ""
            raise ClusterError(f"host ports in use: {busy}; free them (make down stops `make up`)\n{holders}")
        time.sleep(1)


# -- up / down -------------------------------------------------------------------------------------------------

def check_models() -> None:
    """The containers' user (uid 10001) must be able to read every model folder (`make models` writes them so)."""
    if not MODELS.is_dir():
        raise ClusterError("models/ is missing: run `make models`")
    for path in [MODELS, *MODELS.rglob("*")]:
        mode = path.stat().st_mode
        need = 0o005 if path.is_dir() else 0o004
        if mode & need != need:
            raise ClusterError(f"{path} is mode {mode & 0o777:o}: the containers' user cannot read it; "
                               "run `make models` (it repairs the modes)")


def compose_up(engine: Engine, *services: str, attempts: int = 4) -> None:
    """`compose up -d`, again while a port was taken between the check and the bind (see wait_ports_free)."""
    for attempt in range(attempts):
        ours = engine("ps", "-a", "-q", "--filter", f"label={engine.project_label}").stdout.split()
        if not services and not ours:  # our own containers hold the ports once they run
            wait_ports_free()
        start = COMPOSE_LOG.stat().st_size if COMPOSE_LOG.exists() else 0
        done = engine.compose("up", "-d", "--no-build", *services, check=False)
        if done.returncode == 0:
            return
        with COMPOSE_LOG.open() as f:
            f.seek(start)
            output = f.read()
        if "address already in use" not in output or attempt == attempts - 1:
            raise ClusterError(f"compose up exited {done.returncode}:\n{output[-3000:]}")
        log("a published port was taken meanwhile: compose up again")
        time.sleep(3)


def up(install: bool = True, timeout: float = 600) -> Engine:
    timings = Timings()
    with timings("engine setup"):
        engine = find_engine(install)
    log(f"engine: {engine.name} ({' '.join(engine.compose_cmd[:1])})")
    check_models()
    offline = engine.name == "podman" or bool(os.environ.get("TESSERA_OFFLINE_WHEELS"))
    if engine.name == "podman":
        with timings("base image"):
            build_base_image(engine)
        with timings("redis image"):
            build_redis_image(engine)
    if offline:
        with timings("wheelhouse download"):
            if engine.name == "podman":
                prepare_wheelhouse(engine, image_python(engine, BASE_IMAGE), BASE_IMAGE)
            else:  # Docker, told to build offline (TESSERA_OFFLINE_WHEELS): the image is python:3.11-slim
                prepare_wheelhouse(None, "3.11", None)
    with timings("image build"):
        build_images(engine, offline)
    started = time.monotonic()
    with timings("compose up"):
        compose_up(engine)
    with timings("start to healthy"):
        took = wait_healthy(engine, timeout)
    timings.phases["healthy after start, per service"] = took  # type: ignore[assignment]
    timings.phases["start to healthy (from compose up)"] = round(time.monotonic() - started, 1)
    timings.save(engine.name)
    log("the cluster is up:\n" + "\n".join(urls()))
    log(f"stop it with `make cluster-down`; engine {engine.name}, project {PROJECT}")
    return engine


def down(engine: Engine | None = None) -> list[str]:
    """Stop and remove every container, pod, network and volume of the project; returns what is left."""
    engine = engine or engine_if_present()
    if engine is None:
        log("no container engine here: nothing to take down")
        return []
    started = time.monotonic()
    engine.compose("down", "-v", "-t", "45", check=False)
    left = engine.leftovers()
    # What a compose tool did not know of (a container made by hand, a crash mid-up): by label, then name.
    for item in left:
        kind, name = item.split(" ", 1)
        cmd = {"container": ["rm", "-f", "-v"], "pod": ["pod", "rm", "-f"], "network": ["network", "rm"],
               "volume": ["volume", "rm", "-f"]}[kind]
        engine(*cmd, name, check=False)
    left = engine.leftovers()
    log(f"== cluster down: {time.monotonic() - started:.1f}s; "
        + ("nothing left" if not left else "LEFT BEHIND: " + ", ".join(left)))
    return left


def status(engine: Engine | None = None) -> int:
    engine = engine or engine_if_present()
    if engine is None:
        log("no container engine here")
        return NOT_AVAILABLE
    bad = 0
    for name, argv in health_checks().items():
        ok, seen = check_once(engine, name, argv)
        bad += not ok
        print(f"  {name:<10} {'healthy' if ok else 'NOT healthy'}  ({engine.state(name)}; {seen})")
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.cluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="prepare, build and start the compose cluster; wait until healthy")
    p_up.add_argument("--no-install", action="store_true", help="never install an engine (apt-get)")
    p_up.add_argument("--timeout", type=float, default=600, help="seconds to wait for healthy (default 600)")
    sub.add_parser("down", help="remove the cluster's containers, pod, network and volumes")
    sub.add_parser("status", help="each service's compose health check, run in its container")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            up(install=not args.no_install, timeout=args.timeout)
            return 0
        if args.cmd == "down":
            return 1 if down() else 0
        return status()
    except EngineUnavailable as exc:
        print(f"cluster: NOT RUN: {exc}", flush=True)
        return NOT_AVAILABLE
    except ClusterError as exc:
        print(f"cluster: FAILED: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
