"""The run-config reference, docs/configuration.md, rendered from :class:`fedind.config.RunConfig`.

Each field of ``RunConfig`` is one key: its kebab-case name, its default (as TOML, the way
pyproject.toml writes it) and the trailing ``# comment`` of its line in fedind/config.py (a
field without one is described by the comment lines right above it). Comment lines of their
own above a field that has a trailing comment (``# Continual learning ...``) become a
section row. The page is generated, so it cannot drift from the code: tests/test_docs.py checks it
against :func:`render`.

Regenerate after adding or changing a key::

    python -m fedind.configdoc
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import tomllib
from pathlib import Path
from typing import Any

from . import config as config_module
from .config import RunConfig

COMMAND = "python -m fedind.configdoc"
DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

# Which docs page explains a key: the first prefix that matches wins (a key itself is a
# prefix of itself). A key with no match gets no link.
PAGES: tuple[tuple[str, str], ...] = (
    ("num-server-rounds", "overview.md"),
    ("local-", "local-training.md"),
    ("batch-size", "local-training.md"),
    ("learning-rate", "local-training.md"),
    ("logit-adjustment", "local-training.md"),
    ("strategy", "strategies.md"),
    ("fraction-train", "strategies.md"),
    ("proximal-mu", "strategies.md"),
    ("server-learning-rate", "strategies.md"),
    ("server-momentum", "strategies.md"),
    ("fedadam-", "strategies.md"),
    ("trimmed-", "strategies.md"),
    ("krum-", "strategies.md"),
    ("dwa-", "dwa.md"),
    ("conflict-", "dwa.md"),
    ("server-restart", "dwa.md"),
    ("restart-agreement", "dwa.md"),
    ("cclip-", "screening.md"),
    ("alignment-threshold", "screening.md"),
    ("consensus-threshold", "screening.md"),
    ("norm-clip", "screening.md"),
    ("compression", "compression.md"),
    ("topk-", "compression.md"),
    ("downlink", "compression.md"),
    ("encryption", "encryption.md"),
    ("paillier-", "encryption.md"),
    ("data-root", "data-format.md"),
    ("num-sites", "data-format.md"),
    ("dirichlet-alpha", "data-format.md"),
    ("samples-per-site", "data-format.md"),
    ("seed", "data-format.md"),
    ("run-dir", "results.md"),
    ("run-name", "results.md"),
    ("target-accuracy", "results.md"),
    ("model-width", "overview.md"),
    ("device", "gpu.md"),
    ("round-timeout", "deployment.md"),
    ("min-sites", "deployment.md"),
    ("checkpoint-", "checkpoints.md"),
    ("resume", "checkpoints.md"),
    ("overwrite", "results.md"),
    ("metrics-", "deployment.md"),
    ("phase", "continual.md"),
    ("drift-", "continual.md"),
    ("replay-", "continual.md"),
    ("ewc-", "continual.md"),
)

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

HEADER = f"""\
# Run configuration

<!-- Generated from fedind/config.py and pyproject.toml by `{COMMAND}`; do not edit by hand. -->

Every key is a field of `fedind.config.RunConfig` (snake_case) and a kebab-case key of
`[tool.flwr.app.config]` in `pyproject.toml`. `RunConfig`'s defaults (the **default**
column) are the plain baseline that tests, benchmarks and ablations start from;
`pyproject.toml` declares what `flwr run .` runs, and where that differs from the default
the **`flwr run .`** column shows it. Override keys for one run with
`flwr run . --run-config "seed=1 run-name='seed-1'"` (values are TOML: strings in single
quotes inside the double-quoted list, `true`/`false`, numbers). Unknown keys and invalid
values (a value out of range, a wrong type, a combination that cannot work) fail at start
with a message naming the key, before any round runs.

This page is generated from the fields of `RunConfig`, the comment on each field's line and
`pyproject.toml`: after adding or changing a key, run `{COMMAND}` (the test suite fails
until you do). The last column links the page that explains the key.

| key | default | `flwr run .` | meaning | docs |
|---|---|---|---|---|
"""


def pyproject_values(path: Path = PYPROJECT) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of pyproject.toml (empty when there is none, e.g. installed)."""
    if not path.exists():
        return {}
    with open(path, "rb") as f:
        return tomllib.load(f).get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})


def toml_value(value: Any) -> str:
    """A default as pyproject.toml writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def page_of(key: str) -> str:
    for prefix, page in PAGES:
        if key.startswith(prefix):
            return page
    return ""


def _cell(text: str) -> str:
    """Text safe in a markdown table cell: no column breaks, tags or emphasis."""
    for char, escaped in (("|", "\\|"), ("*", "\\*"), ("<", "&lt;"), (">", "&gt;")):
        text = text.replace(char, escaped)
    return text.strip()


def _expand_constants(text: str) -> str:
    """``one of STRATEGIES`` -> ``one of STRATEGIES (fedavg, ...)``: names of tuples of
    strings in fedind.config are spelled out."""

    def spell(match: re.Match[str]) -> str:
        value = getattr(config_module, match.group(0), None)
        if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
            return f"{match.group(0)} ({', '.join(value)})"
        return match.group(0)

    return re.sub(r"\b[A-Z][A-Z0-9_]{2,}\b", spell, text)


def _comments(source: str) -> dict[int, str]:
    """Line number (1-based) -> the text of the comment on that line."""
    found: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


def rows(cls: type = RunConfig) -> list[tuple[str, str, str, str] | str]:
    """One ``(key, default, meaning, page)`` per field in source order, and the text of each
    comment line of its own between fields (a section title)."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = _comments(source)
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    defaults: dict[str, str] = {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = toml_value(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = toml_value(field.default_factory())
        else:
            defaults[field.name] = "(required)"
    out: list[tuple[str, str, str, str] | str] = []
    previous_end = body.body[0].lineno - 1 if body.body else body.lineno
    for node in body.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            break
        # Comment lines of their own above this statement.
        above = [
            comments[number]
            for number in range(previous_end + 1, node.lineno)
            if number in comments and lines[number - 1].lstrip().startswith("#")
        ]
        previous_end = node.end_lineno or node.lineno
        is_field = (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id in defaults  # not a ClassVar or similar
        )
        trailing = " ".join(
            comments[n] for n in range(node.lineno, previous_end + 1) if n in comments
        )
        if not is_field:
            out.extend(above)
            continue
        assert isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        name = node.target.id
        if trailing:
            out.extend(above)  # a section title above a documented field
            meaning = trailing
        else:
            meaning = " ".join(above)  # the field's own comment, written above it
        key = name.replace("_", "-")
        out.append((key, defaults[name], meaning, page_of(key)))
    return out


def render(cls: type = RunConfig, declared: dict[str, Any] | None = None) -> str:
    """The text of docs/configuration.md; ``declared``: the run config ``flwr run .`` runs
    (default: pyproject.toml's)."""
    declared = pyproject_values() if declared is None else declared
    parts = [HEADER]
    for row in rows(cls):
        if isinstance(row, str):
            parts.append(f"| **{_cell(row)}** | | | | |\n")
            continue
        key, default, meaning, page = row
        run = toml_value(declared[key]) if key in declared else "(not declared)"
        run = f"`{_cell(run)}`" if run != default else ""
        link = f"[{page.removesuffix('.md')}]({page})" if page else ""
        parts.append(f"| `{key}` | `{_cell(default)}` | {run} | {_cell(_expand_constants(meaning))} | {link} |\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else ""
        if current != text:
            print(f"{DOC_PATH} is out of date; run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if "--stdout" in argv:
        sys.stdout.write(text)
        return 0
    DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
    DOC_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
