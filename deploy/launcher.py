"""`make up` / `make down`: the fleet as plain local processes, for machines without a container engine.

    python -m deploy.launcher up [--models DIR] [--run-dir DIR] [--port NAME=PORT]...
    python -m deploy.launcher down [--run-dir DIR]

`up` starts every row of `TOPOLOGY` in order, waits until each reports healthy
(redis PING, grpc.health.v1 SERVING, the gateway's /ready), prints the URLs and
stays in the foreground supervising. Ctrl-C (or `down` from another shell)
stops the processes in reverse order: SIGTERM lets each drain, SIGKILL follows
after `--drain-seconds`. If a process dies, the launcher stops the rest and
exits non-zero, naming its log. Logs go to run/logs/NAME.log; run/fleet.json
records the pids (with their start times, so a recycled pid is never
signalled) and `down` stops exactly those processes and nothing else.

The model services share this machine: each gets --threads, its share of the CPUs, and OMP_WAIT_POLICY=PASSIVE
(deploy/threads.py; docs/operation.md, thread settings), unless the environment already sets them.

Flags from the environment: RERANKER_MODEL=DIR serves another cross-encoder than the demo reranker
`make models` trains (models/minilm-gsm8k-reranker). TESSERA_GATEWAY_API_KEY / TESSERA_GATEWAY_ADMIN_KEY go
to the gateway only (child_env); without an API key `up` binds loopback only and refuses any other --host.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from deploy import secrets, threads

ROOT = Path(__file__).resolve().parents[1]


class EnvFlag(NamedTuple):
    """A flag whose value an environment variable sets; `default` (placeholders allowed) when it is unset or
    empty, and no flag at all when there is no default either."""

    flag: str
    env: str
    default: str = ""


@dataclass(frozen=True)
class Service:
    """One process of the fleet. argv placeholders: {python} {host} {port} {models} {run} {secrets} (the folder
    of deploy/secrets.py's files) and {NAME_port}."""

    name: str
    argv: tuple[str, ...]
    port: int
    health: str  # "redis" | "grpc:<service name>" | "http:<path>"
    url: str     # printed once the fleet is up; {host} {port}
    env_flags: tuple[EnvFlag, ...] = ()
    # A model service's share of the machine: its torch threads when services share one (deploy/threads.py)
    # and its cpu request in deploy/k8s. 0: no torch compute (Redis, the gateway).
    compute_share: int = 0


# /v1/models shows this on the random checkpoint, so no caller mistakes its noise for a model's answers.
RANDOM_NOTE = "qwen2-vl-random=RANDOM weights: it proves the image plumbing and its answers are noise"

# The topology. deploy/docker-compose.yml and deploy/k8s mirror it (tests/deploy checks they agree).
# This machine already runs a redis on 6379, so ours defaults to 6380. Two decoders: SmolLM2 (text) and
# qwen2-vl-random (images; RANDOM weights, plumbing only); the gateway routes by model name across them.
# Every gRPC service demands the fleet's backend token and the gateway sends it (services/common/auth.py);
# Redis requires its password. deploy/secrets.py writes both, fresh per `up`, into run/secrets.
TOKEN = ("--backend-token-file", "{secrets}/backend_token")
TOPOLOGY: tuple[Service, ...] = (
    Service("redis", ("redis-server", "{secrets}/redis_conf", "--bind", "{host}", "--port", "{port}", "--save", "",
                      "--appendonly", "no",
                      "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru", "--dir", "{run}"),
            6380, "redis", "redis://{host}:{port}/0"),
    Service("vision", ("{python}", "-m", "services.vision", "--host", "{host}", "--port", "{port}",
                       "--model", "{models}/qwen2-vl-random", "--redis-url", "redis://{host}:{redis_port}/0",
                       "--redis-password-file", "{secrets}/redis_password", *TOKEN),
            50051, "grpc:tessera.vision.v1.VisionService", "{host}:{port} (gRPC)", compute_share=1),
    Service("pooling", ("{python}", "-m", "services.pooling", "--host", "{host}", "--port", "{port}",
                        "--embedding-model", "{models}/all-MiniLM-L6-v2", "--embedding-name", "all-MiniLM-L6-v2",
                        *TOKEN),
            50053, "grpc:tessera.pooling.v1.PoolingService", "{host}:{port} (gRPC)",
            # The demo cross-encoder (`make models`, deploy/reranker.py) unless RERANKER_MODEL names another.
            env_flags=(EnvFlag("--reranker-model", "RERANKER_MODEL", "{models}/minilm-gsm8k-reranker"),),
            compute_share=1),
    # The demo LoRA adapters (`make models`) preloaded; --lora-root lets the gateway's admin endpoints load more.
    Service("decoder", ("{python}", "-m", "services.decoder", "--host", "{host}", "--port", "{port}",
                        "--model", "{models}/SmolLM2-135M-Instruct", "--lora-root", "{models}/adapters",
                        "--lora", "pirate={models}/adapters/pirate", "--lora", "french={models}/adapters/french",
                        *TOKEN),
            50052, "grpc:tessera.decoder.v1.DecoderService", "{host}:{port} (gRPC)", compute_share=2),
    # A small random model needs little KV; the default 1 GiB pool would only take memory.
    Service("decoder-vl", ("{python}", "-m", "services.decoder", "--host", "{host}", "--port", "{port}",
                           "--model", "{models}/qwen2-vl-random", "--kv-cache-gb", "0.25", "--max-loras", "0",
                           *TOKEN),
            50054, "grpc:tessera.decoder.v1.DecoderService", "{host}:{port} (gRPC, qwen2-vl-random: random weights)",
            compute_share=1),
    Service("gateway", ("{python}", "-m", "gateway", "--host", "{host}", "--port", "{port}",
                        "--pooling", "{host}:{pooling_port}", "--decoder", "{host}:{decoder_port}",
                        "--decoder", "{host}:{decoder-vl_port}", "--vision", "{host}:{vision_port}",
                        "--model-note", RANDOM_NOTE, *TOKEN),
            8000, "http:/ready", "http://{host}:{port} (OpenAI base_url http://{host}:{port}/v1)"),
)


# Each service's own variables: the ENV_PREFIX of its config module (tests/deploy holds them equal), by the
# module its argv runs. A child starts without the other services' variables, so the gateway's API and admin
# keys (TESSERA_GATEWAY_API_KEY, TESSERA_GATEWAY_ADMIN_KEY) reach the gateway alone, never Redis or a backend.
ENV_PREFIXES = {"gateway": "TESSERA_GATEWAY_", "services.decoder": "TESSERA_DECODER_",
                "services.vision": "TESSERA_VISION_", "services.pooling": "TESSERA_POOLING_"}
# The keys' names before per-service prefixes: the gateway refuses them naming the new ones; nobody else sees them.
FORMER_KEY_VARIABLES = ("TESSERA_API_KEY", "TESSERA_ADMIN_KEY")
API_KEY_VARIABLE = "TESSERA_GATEWAY_API_KEY"


def module_of(service: Service) -> str:
    """`{python} -m MOD ...` -> MOD; anything else (redis-server) -> its program."""
    argv = service.argv
    return argv[argv.index("-m") + 1] if "-m" in argv[:3] else argv[0]


def thread_settings(cpus: int, environ=os.environ) -> dict[str, threads.ThreadSettings]:
    """Each model row's --threads and OpenMP wait on a machine of `cpus` CPUs (deploy/threads.py): the rows
    share it, so the CPUs are split by compute_share and idle OpenMP workers sleep."""
    rows = [s for s in TOPOLOGY if s.compute_share]
    return threads.fleet({s.name: s.compute_share for s in rows}, cpus, environ,
                         {s.name: ENV_PREFIXES[module_of(s)] + "THREADS" for s in rows})


def child_env(service: Service, environ=os.environ,
              settings: threads.ThreadSettings | None = None) -> dict[str, str]:
    """The environment one row's process starts with: environ less every other service's variables (and the
    former key names, except for the gateway, which refuses them by name), plus its thread settings' variables."""
    own = ENV_PREFIXES.get(module_of(service))
    foreign = tuple(prefix for prefix in ENV_PREFIXES.values() if prefix != own)
    gateway = own == ENV_PREFIXES["gateway"]
    env = {name: value for name, value in environ.items()
           if not name.startswith(foreign) and (gateway or name not in FORMER_KEY_VARIABLES)}
    env["PYTHONUNBUFFERED"] = "1"
    if settings is not None:
        env.update(settings.env)
    return env


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_bind_refusal(host: str, environ=os.environ) -> str | None:
    """Why `up` must not start, when it binds beyond loopback with no API key: the gateway would answer the
    network unauthenticated. None when it may start."""
    if environ.get(API_KEY_VARIABLE) or is_loopback(host):
        return None
    return (f"--host {host} without {API_KEY_VARIABLE}: the gateway would answer every host that reaches it, "
            f"unauthenticated; set {API_KEY_VARIABLE} (and TESSERA_GATEWAY_ADMIN_KEY for the admin endpoints) "
            "or keep the default 127.0.0.1")


def argv_for(service: Service, ports: dict[str, int], host: str, models: Path, run: Path,
             environ=os.environ) -> list[str]:
    """The command line of one row, placeholders filled and env flags added."""
    values = {"python": sys.executable, "host": host, "port": ports[service.name], "models": models, "run": run,
              "secrets": run / "secrets",
              **{f"{name}_port": port for name, port in ports.items()}}
    argv = [part.format(**values) for part in service.argv]
    for flag, env, default in service.env_flags:
        value = environ.get(env) or default.format(**values)
        if value:
            argv += [flag, value]
    return argv


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (/proc), or None if it is gone or a zombie:
    pid + start time names one process, so a recycled pid is never mistaken for ours."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # fields[0] is field 3 of proc(5): the state
    return None if fields[0] in ("Z", "X") else int(fields[19])


def alive(entry: dict) -> bool:
    return start_time(entry["pid"]) == entry["start"]


def healthy(service: Service, host: str, port: int, redis_password: str | None = None) -> bool:
    """One probe of the row's health check."""
    kind, _, arg = service.health.partition(":")
    try:
        if kind == "redis":
            import redis
            return bool(redis.Redis(host=host, port=port, password=redis_password, socket_timeout=1).ping())
        if kind == "grpc":
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            with grpc.insecure_channel(f"{host}:{port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=arg), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        if kind == "http":
            import httpx
            return httpx.get(f"http://{host}:{port}{arg}", timeout=2).status_code == 200
    except Exception:  # noqa: BLE001 - any failure of a probe means "not yet"
        return False
    raise ValueError(f"unknown health check {service.health!r}")


class StartFailed(Exception):
    def __init__(self, name: str, why: str):
        super().__init__(f"{name} {why}")
        self.name = name


class Fleet:
    """The processes one `up` started, recorded in run/fleet.json as they start."""

    def __init__(self, run: Path, host: str, drain_seconds: float):
        self.run, self.host, self.drain_seconds = run, host, drain_seconds
        self.pid_file = run / "fleet.json"
        self.procs: list[tuple[Service, subprocess.Popen, dict]] = []

    def _record(self) -> None:
        me = {"pid": os.getpid(), "start": start_time(os.getpid())}
        data = {"launcher": me, "processes": [entry for _, _, entry in self.procs]}
        tmp = self.pid_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.pid_file)

    def start(self, service: Service, argv: list[str],
              settings: threads.ThreadSettings | None = None) -> subprocess.Popen:
        log_path = self.run / "logs" / f"{service.name}.log"
        with open(log_path, "wb") as log:
            # A new session: Ctrl-C in the terminal reaches only the launcher, which stops children in order.
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=child_env(service, settings=settings))
        entry = {"name": service.name, "pid": proc.pid, "start": start_time(proc.pid), "argv": argv}
        self.procs.append((service, proc, entry))
        self._record()
        return proc

    def wait_healthy(self, service: Service, proc: subprocess.Popen, port: int, timeout: float,
                     stopping: list) -> None:
        deadline = time.monotonic() + timeout
        password = secrets.redis_password(self.run / "secrets")
        while not stopping and not healthy(service, self.host, port, password):
            if proc.poll() is not None:
                raise StartFailed(service.name, f"exited with code {proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise StartFailed(service.name, f"not healthy after {timeout:.0f}s")
            time.sleep(0.2)

    def dead(self) -> tuple[Service, int] | None:
        for service, proc, _ in self.procs:
            if proc.poll() is not None:
                return service, proc.returncode
        return None

    def stop(self) -> None:
        """SIGTERM in reverse start order, each given drain_seconds, then SIGKILL."""
        for service, proc, _ in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(self.drain_seconds)
                except subprocess.TimeoutExpired:
                    print(f"{service.name} did not drain in {self.drain_seconds}s: killed", file=sys.stderr)
                    proc.kill()
                    proc.wait()
        self.pid_file.unlink(missing_ok=True)


def log_tail(run: Path, name: str, lines: int = 20) -> str:
    path = run / "logs" / f"{name}.log"
    text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
    return f"--- last lines of {path}:\n" + "\n".join(text)


def parse_ports(pairs: list[str]) -> dict[str, int]:
    ports = {s.name: s.port for s in TOPOLOGY}
    for pair in pairs:
        name, _, port = pair.partition("=")
        if name not in ports or not port.isdigit():
            raise SystemExit(f"--port {pair!r}: want NAME=PORT with NAME one of {list(ports)}")
        ports[name] = int(port)
    return ports


def up(args) -> int:
    run = args.run_dir.resolve()
    (run / "logs").mkdir(parents=True, exist_ok=True)
    pid_file = run / "fleet.json"
    if pid_file.exists():
        old = json.loads(pid_file.read_text())
        if alive(old["launcher"]):
            print(f"the fleet is already up (launcher pid {old['launcher']['pid']}); `make down` first",
                  file=sys.stderr)
            return 1
    refusal = open_bind_refusal(args.host)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if not os.environ.get(API_KEY_VARIABLE):
        print(f"no {API_KEY_VARIABLE}: the gateway takes calls without a key, from this host only ({args.host})",
              flush=True)
    models = args.models.resolve()
    ports = parse_ports(args.port)
    print(f"backend token and Redis password (new for this fleet): {secrets.ensure(run / 'secrets', fresh=True)}",
          flush=True)
    cpus = threads.machine_cpus()
    settings = thread_settings(cpus)
    print(threads.describe(settings, cpus), flush=True)
    fleet = Fleet(run, args.host, args.drain_seconds)
    stopping = []
    # SIGTERM (from `down`) and Ctrl-C both mean: drain and stop everything started here.
    previous = {sig: signal.signal(sig, lambda *_: stopping.append(True)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for service in TOPOLOGY:
            if stopping:
                break
            setting = settings.get(service.name)
            argv = argv_for(service, ports, args.host, models, run) + (setting.argv() if setting else [])
            print(f"starting {service.name}: {' '.join(argv)}", flush=True)
            proc = fleet.start(service, argv, setting)
            fleet.wait_healthy(service, proc, ports[service.name], args.start_timeout, stopping)
        if not stopping:
            urls = "".join(f"  {s.name:<10} {s.url.format(host=args.host, port=ports[s.name])}\n" for s in TOPOLOGY)
            print(f"\ntessera is up:\n{urls}logs in {run / 'logs'}; stop with Ctrl-C or `make down`\n", flush=True)
        while not stopping:
            gone = fleet.dead()
            if gone:
                print(f"{gone[0].name} exited with code {gone[1]}; stopping the fleet\n"
                      + log_tail(run, gone[0].name), file=sys.stderr)
                return 1
            time.sleep(0.5)
        print("stopping the fleet", flush=True)
        return 0
    except StartFailed as exc:
        print(f"{exc}\n{log_tail(run, exc.name)}", file=sys.stderr)
        return 1
    finally:
        fleet.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def down(args) -> int:
    """Stop what `up` recorded: the launcher (which drains its children), then any child left behind."""
    pid_file = args.run_dir.resolve() / "fleet.json"
    if not pid_file.exists():
        print("nothing to stop: no fleet.json (is the fleet up?)")
        return 0
    data = json.loads(pid_file.read_text())
    launcher = data["launcher"]
    if alive(launcher):
        os.kill(launcher["pid"], signal.SIGTERM)
        deadline = time.monotonic() + args.drain_seconds * len(data["processes"]) + 10
        while alive(launcher) and time.monotonic() < deadline:
            time.sleep(0.2)
    # Children of a launcher that was killed outright: stopped here, newest first.
    for entry in reversed(data["processes"]):
        if alive(entry):
            os.kill(entry["pid"], signal.SIGTERM)
            deadline = time.monotonic() + args.drain_seconds
            while alive(entry) and time.monotonic() < deadline:
                time.sleep(0.2)
            if alive(entry):
                os.kill(entry["pid"], signal.SIGKILL)
    pid_file.unlink(missing_ok=True)
    print("the fleet is down")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.launcher", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("up", "start the fleet and supervise it in the foreground"),
                           ("down", "stop the fleet `up` started")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--run-dir", type=Path, default=ROOT / "run", help="pid file and logs (default: run/)")
        p.add_argument("--drain-seconds", type=float, default=30.0,
                       help="how long each process may drain after SIGTERM before SIGKILL (default: 30)")
    p = sub.choices["up"]
    p.add_argument("--models", type=Path, default=ROOT / "models", help="prepared models (default: models/)")
    p.add_argument("--host", default="127.0.0.1", help="address every process binds (default: 127.0.0.1)")
    p.add_argument("--port", action="append", default=[], metavar="NAME=PORT",
                   help="override a port: " + ", ".join(f"{s.name}={s.port}" for s in TOPOLOGY))
    p.add_argument("--start-timeout", type=float, default=180.0,
                   help="seconds each process may take to become healthy (default: 180)")
    args = parser.parse_args(argv)
    return up(args) if args.command == "up" else down(args)


if __name__ == "__main__":
    sys.exit(main())
