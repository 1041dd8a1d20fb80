"""The README and docs/: the generated run-config reference is current, every
``--federation-config`` / ``--run-config`` they show is accepted by the installed Flower and
by fedind, links resolve, and the README stays a short front door. CPU only, no runs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from flwr.common.config import get_fused_config_from_dir, parse_config_args
from flwr.supercore.utils import simulation_config_from_json

from fedind import configdoc
from fedind.config import ConfigError, RunConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
TEST_COMMAND = 'pip install "torch==2.13.0" -e ".[test]" && pytest -q'
RUN_COMMAND = (
    'pip install "torch==2.13.0" -e . && FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 '
    'flwr run . --stream --federation-config "num-supernodes=10 client-resources-num-cpus=1"'
)
OLD_GPU_FEDERATION_CONFIG = (
    "num-supernodes=10 backend.client-resources.num-cpus=2 backend.client-resources.num-gpus=0.25"
)


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


# ----------------------------------------------------------- generated run-config reference


def test_configuration_doc_is_generated_from_the_run_config():
    current = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert current == configdoc.render(), (
        f"docs/configuration.md does not match fedind.config.RunConfig; regenerate it with "
        f"`{configdoc.COMMAND}` and commit the result"
    )


def test_configuration_doc_has_one_row_per_key():
    keys = [row[0] for row in configdoc.rows() if not isinstance(row, str)]
    assert keys == list(RunConfig().to_flower())
    assert all(row[1] != "(required)" for row in configdoc.rows() if not isinstance(row, str))


def test_configdoc_reads_the_trailing_comment_and_section_lines():
    rows = configdoc.rows()
    as_dict = {row[0]: row for row in rows if not isinstance(row, str)}
    assert as_dict["num-server-rounds"][1:3] == ("80", "federated rounds")
    assert as_dict["strategy"][1] == '"fedavgm"'
    assert as_dict["resume"][1] == "false"
    assert as_dict["topk-ratio"][3] == "compression.md"
    assert any(isinstance(row, str) and row.startswith("Continual learning") for row in rows)
    text = configdoc.render()
    # pipes and angle brackets in comments must not break the table
    assert "int8 \\| int4" in text and "&lt;run-name&gt;" in text


@dataclass(frozen=True)
class _Sample:
    alpha: int = 1  # first
    # Section title
    beta: str = "x|y"  # second
    # the comment above gamma
    # spans two lines
    gamma: bool = False


def test_configdoc_takes_a_fields_comment_from_above_when_its_line_has_none():
    assert configdoc.rows(_Sample) == [
        ("alpha", "1", "first", ""),
        "Section title",
        ("beta", '"x|y"', "second", ""),
        ("gamma", "false", "the comment above gamma spans two lines", ""),
    ]
    text = configdoc.render(_Sample, declared={"alpha": 1, "beta": "z", "gamma": False})
    assert '| `alpha` | `1` |  | first |  |' in text  # flwr run . runs the default
    assert '| `beta` | `"x\\|y"` | `"z"` | second |  |' in text


# -------------------------------------------------------------------- the README front door


def test_readme_is_at_most_250_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"


def test_readme_opens_with_the_run_and_test_commands():
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)
    assert blocks[:2] == [RUN_COMMAND, TEST_COMMAND]
    first_block = text.index("```bash")
    assert text[:first_block].count("\n") <= 3, "the two commands come first"


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert TEST_COMMAND in ci
    assert TEST_COMMAND in README.read_text(encoding="utf-8").splitlines()


def test_readme_key_table_matches_the_run_config_and_pyproject():
    text = README.read_text(encoding="utf-8")
    section = text.split("## The ten most used run-config keys", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| `([^`]*)` \| `([^`]*)` \|", section, flags=re.M)
    assert len(rows) == 10
    defaults = RunConfig().to_flower()
    declared = configdoc.pyproject_values()
    for key, run, default in rows:
        assert key in defaults, f"README lists unknown run-config key {key!r}"
        assert run == configdoc.toml_value(declared[key]), f"README: what flwr run . uses for {key}"
        assert default == configdoc.toml_value(defaults[key]), f"README: RunConfig default of {key}"


SEARCHED = ("README.md", "docs", "fedind", "server", "client", "simulations", "tests", "deploy", "pyproject.toml", ".ci")
# Spelled in pieces so that this file does not match itself.
OUTSIDE = ("DESIGN" + ".md", "../" + "shared")


def test_no_file_cites_anything_outside_the_project():
    offenders = []
    for name in SEARCHED:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            if "__pycache__" in file.parts or file.suffix in (".png", ".pyc"):
                continue
            text = file.read_text(encoding="utf-8", errors="replace")
            offenders += [f"{file.relative_to(ROOT)}: {word}" for word in OUTSIDE if word in text]
    assert not offenders, "cite the project's own docs instead: " + ", ".join(offenders)


# ------------------------------------------------ --federation-config and --run-config strings

CONFIG_FLAG = re.compile(r"--(federation|run)-config(?:\s|\\)+\"([^\"]*)\"")


def config_strings() -> list[tuple[str, str, str]]:
    """(where, kind, value) for every quoted --federation-config / --run-config in the docs."""
    found = []
    for file in markdown_files():
        text = file.read_text(encoding="utf-8")
        for match in CONFIG_FLAG.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            value = match.group(2).replace("\\\n", "")  # a shell line continuation inside the quotes
            found.append((f"{file.relative_to(ROOT)}:{line}", match.group(1), value))
    return found


def check_federation_config(value: str) -> None:
    """What `flwr run --federation-config` does with the value (Flower 1.42,
    flwr.cli.run.run._parse_federation_config_overrides): parse as TOML pairs, kebab-case
    keys to the SimulationConfig proto's field names, set each field."""
    pairs = parse_config_args([value])
    simulation_config_from_json({key.replace("-", "_"): v for key, v in pairs.items()})


def check_run_config(value: str) -> None:
    """What `flwr run . --run-config` hands the app: the TOML pairs fused over pyproject.toml's
    run config (an unknown key is refused there), read as fedind reads it."""
    RunConfig.from_flower(get_fused_config_from_dir(ROOT, parse_config_args([value])))


ALL_CONFIG_STRINGS = config_strings()


def test_the_docs_show_config_strings_of_both_kinds():
    kinds = [kind for _, kind, _ in ALL_CONFIG_STRINGS]
    assert kinds.count("federation") >= 3 and kinds.count("run") >= 5


@pytest.mark.parametrize(
    "where, kind, value", ALL_CONFIG_STRINGS, ids=[f"{w}-{k}" for w, k, _ in ALL_CONFIG_STRINGS]
)
def test_every_config_string_in_the_docs_is_accepted(where, kind, value):
    check = check_federation_config if kind == "federation" else check_run_config
    try:
        check(value)
    except (ValueError, TypeError, ConfigError) as error:  # ConfigError is a ValueError
        pytest.fail(f"{where}: --{kind}-config \"{value}\" is refused: {error}")


def test_the_old_gpu_federation_config_is_refused():
    """The dotted keys of older Flower releases; Flower 1.42 refuses them at `flwr run`."""
    with pytest.raises(ValueError, match="Unknown simulation config field"):
        check_federation_config(OLD_GPU_FEDERATION_CONFIG)
    check_federation_config("num-supernodes=10 client-resources-num-cpus=2 client-resources-num-gpus=0.25")
    with pytest.raises(TypeError):  # num-cpus is a whole number in Flower's SimulationConfig
        check_federation_config("client-resources-num-cpus=0.5")


def test_the_checker_finds_a_refused_string_in_text():
    text = f'flwr run . --federation-config \\\n  "{OLD_GPU_FEDERATION_CONFIG}" --run-config "no-such-key=1"'
    (_, kind1, value1), (_, kind2, value2) = [
        ("", m.group(1), m.group(2)) for m in CONFIG_FLAG.finditer(text)
    ]
    assert (kind1, kind2) == ("federation", "run")
    with pytest.raises(ValueError):
        check_federation_config(value1)
    with pytest.raises(ValueError, match="no-such-key"):
        check_run_config(value2)
    with pytest.raises(ConfigError, match="topk-ratio"):
        check_run_config("compression='topk' topk-ratio=0")


# ------------------------------------------------------------------------- links and pages


def github_slug(heading: str) -> str:
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(file: Path) -> set[str]:
    slugs: dict[str, int] = {}
    out = set()
    in_code = False
    for line in file.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        match = re.match(r"#{1,6} (.*)", line)
        if match and not in_code:
            slug = github_slug(match.group(1))
            n = slugs.get(slug, 0)
            slugs[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for file in markdown_files():
        text = re.sub(r"```.*?```", "", file.read_text(encoding="utf-8"), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path_part, _, anchor = target.partition("#")
            path = (file.parent / path_part).resolve() if path_part else file
            where = f"{file.relative_to(ROOT)} -> {target}"
            if not path.exists():
                broken.append(where)
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(where + " (no such heading)")
    assert not broken, "broken links: " + ", ".join(broken)


def test_the_figures_kept_in_docs_are_still_shown():
    """The figures that were in docs/ when the README moved there (others may add more)."""
    linked = set()
    for file in markdown_files():
        linked |= {Path(t).name for t in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", file.read_text(encoding="utf-8"))}
    kept = {
        "compression-epochs3.png", "compression.png", "continual.png", "convergence-160-alpha0.1.png",
        "convergence-alpha0.1.png", "convergence-alpha0.5.png", "convergence-bound-alpha0.1.png",
        "convergence-bound-alpha0.5.png", "convergence-full.png", "default-run.png",
    }
    assert kept <= linked, f"figures no page shows any more: {sorted(kept - linked)}"


@pytest.mark.parametrize("page", sorted(p.name for p in (DOCS / "benchmarks").glob("*.md")))
def test_every_benchmark_page_names_the_commands_that_regenerate_it(page):
    text = (DOCS / "benchmarks" / page).read_text(encoding="utf-8")
    assert re.search(r"python simulations/\S+\.py|flwr run \.", text), page
