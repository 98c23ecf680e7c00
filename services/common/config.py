"""Frozen config dataclasses read from CLI flags, then environment, then defaults.

Declare a concern as a frozen dataclass whose fields use `option(...)`; `load`
builds the argparse parser (so `--help` explains every flag and its env var),
resolves flags > env > defaults, and validates through the dataclass's
`__post_init__` (a ValueError there becomes a clear usage error, exit 2).

Environment variables carry one prefix per process (TESSERA_DECODER_, TESSERA_VISION_, TESSERA_POOLING_,
TESSERA_GATEWAY_, each declared as ENV_PREFIX in that service's config module), so one environment, a
Kubernetes ConfigMap or a shell, can hold every service's settings without one service reading another's.
This module and the services' config modules are the only readers of TESSERA_ variables.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import types
import typing

log = logging.getLogger("tessera.config")

# Where the C++ operators are built and found (services/common/native.py); unset: build/torch_extensions
# under the repository. A build directory shared by machines with different CPUs keeps one build per CPU
# there, so each machine can point this at a directory of its own.
KERNELS_DIR_ENV = "TESSERA_KERNELS_DIR"
# Before per-service prefixes the gRPC services read TESSERA_<FIELD>; such a variable is refused with its
# new name rather than silently ignored (config.load's former_prefix).
FORMER_PREFIX = "TESSERA_"


def kernels_dir(environ=None) -> str | None:
    """$TESSERA_KERNELS_DIR, or None when it is unset or empty."""
    environ = os.environ if environ is None else environ
    return environ.get(KERNELS_DIR_ENV) or None


def option(default, help: str, *, choices=None, env: str | None = None, metavar: str | None = None,
           formerly: str | None = None):
    """A config field. env overrides the derived PREFIX_FIELD variable name; formerly names a variable the
    field was read from before (refused, naming the new one, when set without it)."""
    meta = {"help": help, "choices": choices, "env": env, "metavar": metavar, "formerly": formerly}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple default; config is immutable")
    return dataclasses.field(default=default, metadata=meta)


def _base_type(tp):
    """(scalar type, is_tuple) for str/int/float/bool, Optional[...] and tuple[str, ...]."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin is tuple:
        return typing.get_args(tp)[0], True
    return tp, False


def _convert(scalar, raw: str, name: str):
    if scalar is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{name}: {raw!r} is not a boolean")
    try:
        return scalar(raw)
    except ValueError:
        raise ValueError(f"{name}: {raw!r} is not a valid {scalar.__name__}") from None


def add_arguments(parser: argparse.ArgumentParser, cls, env_prefix: str) -> None:
    """Add one flag per field of cls to parser; help shows default and env var."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__doc__.strip().splitlines()[0] if cls.__doc__ else cls.__name__)
    for f in dataclasses.fields(cls):
        scalar, many = _base_type(hints[f.name])
        env = f.metadata.get("env") or f"{env_prefix}{f.name.upper()}"
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} (default: {f.default!r}; env {env})"
        kwargs = {"dest": f.name, "default": None, "help": help_text}
        if f.metadata.get("metavar"):
            kwargs["metavar"] = f.metadata["metavar"]
        if scalar is bool and not many:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = str
            if f.metadata.get("choices"):
                kwargs["choices"] = f.metadata["choices"]
            if many:
                kwargs["action"] = "append"
        group.add_argument(flag, **kwargs)


def _check_renamed(env: str, former: str, environ) -> None:
    if former != env and environ.get(former) is not None and environ.get(env) is None:
        raise ValueError(f"{former} is no longer read: set {env} instead")


def resolve(cls, args: argparse.Namespace, env_prefix: str, environ=None, former_prefix: str | None = None):
    """An instance of cls from parsed flags, then the environment, then defaults. A variable named with
    former_prefix (or a field's `formerly`) and not with the new name is a ValueError naming the new one."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        scalar, many = _base_type(hints[f.name])
        env = f.metadata.get("env") or f"{env_prefix}{f.name.upper()}"
        former = f.metadata.get("formerly") or (former_prefix and f"{former_prefix}{f.name.upper()}")
        if former:
            _check_renamed(env, former, environ)
        raw = getattr(args, f.name, None)
        if raw is None and environ.get(env) is not None:
            raw = environ[env].split(",") if many else environ[env]
            raw = [r for r in raw if r] if many else raw
        if raw is None:
            continue
        if isinstance(raw, bool):
            values[f.name] = raw
        elif many:
            values[f.name] = tuple(_convert(scalar, r, f.name) for r in raw)
        else:
            values[f.name] = _convert(scalar, raw, f.name)
        choices = f.metadata.get("choices")
        if choices and not many and values[f.name] not in choices:
            raise ValueError(f"{f.name}: {values[f.name]!r} is not one of {list(choices)}")
    return cls(**values)


def load(classes, argv=None, *, prog: str, description: str, env_prefix: str, environ=None,
         former_prefix: str | None = None):
    """Parse argv into one instance per dataclass in `classes` (a tuple), validated.

    env_prefix is the service's own (its config module's ENV_PREFIX). Returns a tuple in the same
    order. Invalid values exit with status 2 and a message naming the flag.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.HelpFormatter)  # each help already names its default
    for cls in classes:
        add_arguments(parser, cls, env_prefix)
    args = parser.parse_args(argv)
    try:
        return tuple(resolve(cls, args, env_prefix, environ, former_prefix) for cls in classes)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))


def log_config(*configs, hidden: tuple[str, ...] = ()) -> None:
    """Log the resolved configuration once at start; a field named in hidden that is set shows as
    "<NAME set>" (a secret never reaches a log). The values are replaced in the logged dict, not through
    dataclasses.replace, which would run the config's checks on the placeholders."""
    for cfg in configs:
        values = dataclasses.asdict(cfg)
        values.update({name: f"<{name} set>" for name in hidden if values.get(name)})
        log.info("config %s %s", type(cfg).__name__, json.dumps(values, default=str))
