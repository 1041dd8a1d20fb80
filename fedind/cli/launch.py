"""``fedind check-config`` and ``fedind run``: what ``flwr run`` does not tell a user.

``flwr run`` refuses a run-config key that pyproject.toml does not declare with only
``[code: 15] Invalid run configuration.`` (the key is named in the SuperLink's log), and it
exits 0 when the ServerApp fails. So::

    fedind check-config [APP_DIR] [--run-config "k=v ..."]...
        check the run config that ``flwr run APP_DIR --run-config ...`` would start, as
        fedind's ServerApp will (RunConfig); a bad key or value is named, with the nearest
        known key for a typo. Exit 0 when it would start, 2 otherwise.
    fedind run [APP_DIR] [any flwr run option...]
        check-config, then ``flwr run ... --stream``; its output passes through, and a
        failed run ends with ``fedind: error: the run failed: <cause>`` and exit status 1.

Overrides are parsed by Flower's own parser (``flwr.common.config.parse_config_args``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..config import ConfigError, RunConfig, suggest_key

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXIT_CODE = re.compile(r"Exit Code: (\d+)")
FAILED_MARK = "fedind: the run failed: "  # the ERROR line fedind's ServerApp ends a failed run with


def app_run_config(app_dir: Path, overrides: Sequence[str] | None) -> dict[str, Any]:
    """The run config ``flwr run app_dir --run-config <overrides>`` hands the ServerApp:
    pyproject's ``[tool.flwr.app.config]`` with the overrides. An override key pyproject does
    not declare is a ConfigError naming it (Flower would refuse the run without naming it)."""
    import click
    from flwr.common.config import flatten_dict, parse_config_args

    path = Path(app_dir) / "pyproject.toml"
    with open(path, "rb") as f:
        defaults = flatten_dict(tomllib.load(f).get("tool", {}).get("flwr", {}).get("app", {}).get("config", {}))
    try:
        parsed = parse_config_args(list(overrides) if overrides else None)
    except click.ClickException as err:
        raise ConfigError(f"--run-config: {err.message}") from err
    for key in parsed:
        if key not in defaults:
            raise ConfigError(
                f"Unknown run config key {key!r}{suggest_key(key)} in --run-config: {path} does not declare it, "
                f"and flwr run would refuse the run with only '[code: 15] Invalid run configuration.'"
            )
    return {**defaults, **parsed}


def check_config(app_dir: Path, overrides: Sequence[str] | None) -> RunConfig:
    """The RunConfig the ServerApp would build; ConfigError naming the first bad key."""
    return RunConfig.from_flower(app_run_config(app_dir, overrides))


def run_failure(lines: Iterable[str], returncode: int) -> str | None:
    """The one-line cause of a failed ``flwr run --stream`` from its output, or None when
    it succeeded: fedind's own failure line, else Flower's ``Exit Code: <n>`` (n >= 100)
    with the message after it, else a non-zero exit status."""
    lines = [_ANSI.sub("", line).rstrip() for line in lines]
    for line in lines:
        if FAILED_MARK in line:
            return line.split(FAILED_MARK, 1)[1].strip()
    for i, line in enumerate(lines):
        match = _EXIT_CODE.search(line)
        if match and not 0 <= int(match.group(1)) < 100:
            message = next((rest.strip() for rest in lines[i + 1:] if rest.strip()), "")
            return f"Flower exit code {match.group(1)}" + (f": {message}" if message else "")
    if returncode != 0:
        last = next((line.strip() for line in reversed(lines) if line.strip()), "")
        return f"flwr run exited with status {returncode}" + (f": {last}" if last else "")
    return None


def _run_config_args(flwr_args: Sequence[str]) -> list[str]:
    """The values of ``--run-config`` / ``-c`` among ``flwr run``'s arguments."""
    values, args = [], list(flwr_args)
    for i, arg in enumerate(args):
        if arg in ("--run-config", "-c") and i + 1 < len(args):
            values.append(args[i + 1])
        elif arg.startswith("--run-config="):
            values.append(arg.split("=", 1)[1])
    return values


def _check_command(args: argparse.Namespace) -> int:
    config = check_config(args.app, args.run_config)
    print(f"run config OK: strategy {config.strategy}, {config.num_server_rounds} rounds, "
          f"{'data-root ' + config.data_root if config.data_root else f'{config.num_sites} synthetic sites'}")
    return 0


def _run_command(args: argparse.Namespace) -> int:
    # --run-config before APP_DIR is parsed here, after it it is among the flwr run options
    flwr_args = [arg for value in args.run_config or [] for arg in ("--run-config", value)] + list(args.flwr_args)
    check_config(args.app, _run_config_args(flwr_args))
    command = ["flwr", "run", str(args.app), *flwr_args, *([] if "--stream" in flwr_args else ["--stream"])]
    lines: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
    cause = run_failure(lines, proc.returncode)
    if cause is not None:
        print(f"fedind: error: the run failed: {cause}", file=sys.stderr)
        return 1
    return 0


def _add_app_arguments(parser: argparse.ArgumentParser) -> None:
    """APP_DIR and --run-config, as flwr run takes them."""
    parser.add_argument("app", nargs="?", type=Path, default=Path("."), metavar="APP_DIR", help="default: .")
    parser.add_argument("--run-config", "-c", action="append", metavar="'k=v ...'", help="as for flwr run")


def add_commands(commands: argparse._SubParsersAction) -> None:
    """``fedind check-config`` and ``fedind run`` (fedind.cli)."""
    check = commands.add_parser(
        "check-config", help="check a run config before flwr run sees it",
        description="Check the run config that `flwr run APP_DIR --run-config ...` would start: every key "
        "known, every value valid (a typo is named, with the nearest key).",
    )
    _add_app_arguments(check)
    check.set_defaults(run=_check_command)
    run = commands.add_parser(
        "run", help="check-config, then flwr run --stream; a failed run exits 1 with its cause",
        description="Check the run config, then run `flwr run APP_DIR <options> --stream`; unlike flwr run, "
        "a run whose ServerApp fails ends with one line naming the cause and exit status 1.",
    )
    _add_app_arguments(run)
    run.add_argument("flwr_args", nargs=argparse.REMAINDER, metavar="...", help="options passed to flwr run")
    run.set_defaults(run=_run_command)
