"""The package layout: the maths imports without Flower, imports point down, modules stay
small, and every module path the docs, docstrings and comments cite exists. CPU only, no runs."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fedind"

# The pure parts: numpy, torch, phe and gmpy2, no Flower.
PURE = (
    "fedind.aggregation.weighting", "fedind.aggregation.conflicts", "fedind.aggregation.averaging",
    "fedind.topk.selection", "fedind.topk.feedback", "fedind.topk.blocks", "fedind.topk.codec",
    "fedind.paillier.keys", "fedind.paillier.packing",
    "fedind.continual.phases", "fedind.continual.replay", "fedind.continual.ewc", "fedind.continual.expansion",
    "fedind.models", "fedind.training", "fedind.config", "fedind.wire", "fedind.files", "fedind.store",
    "fedind.data.format", "fedind.data.federation", "fedind.data.drift", "fedind.data.sources",
    "fedind.data.gearbox", "fedind.centralized",
)
# Packages and modules that stand above the features: a feature or the core never imports them.
UPPER = ("fedind.server", "fedind.site", "fedind.edge", "fedind.cli", "fedind.simulation", "fedind.loopback")
LOWER = ("aggregation", "topk", "paillier", "continual", "data", "config", "configdoc", "models", "training",
         "wire", "files", "store", "centralized", "records")
MAX_LINES = 600  # "about 500": a module past this has more than one concept in it
SEARCHED = ("README.md", "docs", "fedind", "server", "client", "simulations", "tests", "deploy", "pyproject.toml", ".ci")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def fedind_imports(path: Path) -> set[str]:
    """The fedind modules (or packages) ``path`` imports, relative imports resolved."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found |= {f"{target}.{a.name}" for a in node.names} | {target}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {t for t in found if t == "fedind" or t.startswith("fedind.")}


def test_the_maths_imports_without_flower():
    script = (
        "import importlib, json, sys; sys.modules['flwr'] = None; failed = {}\n"
        f"for name in {PURE!r}:\n"
        "    try: importlib.import_module(name)\n"
        "    except ImportError as err: failed[name] = str(err)\n"
        "print(json.dumps(failed))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


def test_features_and_the_core_never_import_the_server_the_site_or_the_tools():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name == "fedind" or name.split(".")[1] not in LOWER:
            continue
        offenders += [f"{name} -> {t}" for t in fedind_imports(path) if t.startswith(UPPER)]
    assert not offenders, "imports that point up: " + ", ".join(sorted(offenders))


def test_the_site_never_imports_the_server():
    """The site agent and the server share the features and the core, never each other."""
    offenders = []
    for path in sorted((PACKAGE / "site").rglob("*.py")):
        offenders += [f"{module_name(path)} -> {t}" for t in fedind_imports(path) if t.startswith("fedind.server")]
    for path in sorted((PACKAGE / "server").rglob("*.py")):
        offenders += [f"{module_name(path)} -> {t}" for t in fedind_imports(path) if t.startswith("fedind.site")]
    assert not offenders, "imports between the site and the server: " + ", ".join(sorted(offenders))


def test_no_module_is_much_over_500_lines():
    long = {module_name(p): n for p in PACKAGE.rglob("*.py") if (n := p.read_text(encoding="utf-8").count("\n")) > MAX_LINES}
    assert not long, f"split these along their concepts: {long}"


def defined_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def resolves(dotted: str) -> bool:
    """A dotted path under fedind: a module or package, then (if any) a name it defines."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[cut:]
            if not rest or rest[0].startswith("__"):
                return True
            if rest[0] in defined_names(module):
                return True
            return (base / rest[0]).is_dir() or (base / f"{rest[0]}.py").is_file()
    return False


DOTTED = re.compile(r"(?<![\w.])fedind(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w/.-])fedind/(?:\w+/)*(?:\w+\.py|\w+/)")


def cited_files():
    for name in SEARCHED:
        path = ROOT / name
        for file in [path] if path.is_file() else sorted(path.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts and file.suffix not in (".png", ".pyc", ".json"):
                yield file


def test_every_cited_module_path_exists():
    broken = []
    for file in cited_files():
        text = file.read_text(encoding="utf-8", errors="replace")
        for match in DOTTED.finditer(text):
            before, after = text[match.start() - 1 : match.start()], text[match.end() : match.end() + 1]
            if before in "\"'" and before == after:  # a format name or logger name, not a module path
                continue
            if not resolves(match.group(0)):
                broken.append(f"{file.relative_to(ROOT)}: {match.group(0)}")
        broken += [f"{file.relative_to(ROOT)}: {m}" for m in PATH.findall(text) if not (ROOT / m).exists()]
    assert not broken, "cited module paths that do not exist: " + ", ".join(sorted(set(broken)))


@pytest.mark.parametrize("dotted, ok", [
    ("fedind.server.app.run_server", True), ("fedind.topk", True), ("fedind.serverapp", False),
    ("fedind.topk.codec.ErrorFeedback", False), ("fedind.topk.feedback.ErrorFeedback.compress", True),
])
def test_the_path_checker_itself(dotted, ok):
    assert resolves(dotted) is ok
