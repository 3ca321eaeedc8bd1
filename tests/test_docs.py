"""The documentation: the configuration reference lists every key of RunConfig (written from the
code by docs/hooks.py, committed, and current), the site builds with ``mkdocs build --strict``
(a dead link, an unknown anchor or a page missing from the navigation fails it), and every
relative link resolves on the repository too."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
import typing
import unicodedata
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify
from pydantic import BaseModel

from pipeline.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent


def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def section_of(annotation) -> tuple[type[BaseModel] | None, bool]:
    """The pydantic model a field holds, directly or as list items (``X | None`` unwrapped)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = inner[0] if len(inner) == 1 else annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, True
    return None, False


def key_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of ``model``, sections and lists of sections walked recursively (list items as []).
    The reference has a row for each, and a heading for each top-level section."""
    paths = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        paths.append(path)
        inner, is_list = section_of(field.annotation)
        if inner is not None:
            paths += key_paths(inner, path + ("[]" if is_list else ""))
    return paths


def test_the_configuration_reference_lists_every_key_of_runconfig_with_its_default():
    page = hooks().render_configuration()
    paths = key_paths(RunConfig)
    assert len(paths) > 150  # sanity: the walk reached the nested sections and list items
    for must in ("data.sources[].path", "merge.methods[].rules[].pattern", "diloco.methods[].outer_lr"):
        assert must in paths
    rows = {line.split("|")[1].strip().strip("`"): line for line in page.splitlines() if line.startswith("| `")}
    headings = {line.split("`")[1] for line in page.splitlines() if line.startswith("#") and "`" in line}
    missing = [p for p in paths if p not in rows and not ("." not in p and p in headings)]
    assert not missing, f"keys missing from the configuration reference: {missing}"
    # Each row carries the default the code has, and the comment written beside the field.
    assert "`0.001`" in rows["train.lr"] and "per process" in rows["train.micro_batch"]
    assert "required" in rows["data.sources[].name"] and "`OPENAI_API_KEY`" in rows["eval.judge.api_key_env"]
    assert "delayed Nesterov" in rows["diloco.sync"] and "diloco-part" in rows["diloco.aggregator_deployment"]


def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reference = (site / "reference" / "configuration" / "index.html").read_text()
    assert "diloco.aggregator_deployment" in reference
    assert (site / "results" / "2026-12-01-diloco" / "index.html").is_file()


def test_contributing_places_every_test_module_in_a_tier():
    """CONTRIBUTING.md's tier table names each module of tests/ once, and no module that is gone."""
    import re

    table = [line for line in (ROOT / "CONTRIBUTING.md").read_text().splitlines() if line.startswith("| ")]
    named = re.findall(r"`(test_\w+)`", "\n".join(row.split("|")[2] for row in table if row.count("|") >= 4))
    modules = sorted(p.stem for p in (ROOT / "tests").glob("test_*.py"))
    assert sorted(named) == modules


def test_the_generated_reference_pages_are_committed_as_the_code_gives_them():
    assert not hooks().stale_pages(), "run `make reference`"


def test_every_key_of_the_reference_pages_has_a_description():
    docs = hooks()
    assert docs.undescribed(docs.configuration_sections()) == []
    assert docs.undescribed(docs.merge_spec_sections()) == []


UNDESCRIBED = """
from pydantic import BaseModel


class Inner(BaseModel):
    kept: int = 0  # a key with its comment
    bare: int = 0


class Outer(BaseModel):
    # a section, described above its line
    inner: Inner = Inner()
    items: list[Inner] = []  # a list of sections
    plain: str = ""
"""


def test_a_key_without_a_description_fails_the_reference_and_the_build(tmp_path, monkeypatch):
    """A field with no comment, at the top or inside a section or list item, is named with its file;
    ``make reference`` (the page's render) and the site's build both refuse it."""
    from mkdocs.exceptions import PluginError

    source = tmp_path / "undescribed_models.py"
    source.write_text(UNDESCRIBED)
    spec = importlib.util.spec_from_file_location("undescribed_models", source)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "undescribed_models", module)
    spec.loader.exec_module(module)
    docs = hooks()
    walked = docs.sections(module.Outer, "")
    where = source.resolve()
    assert docs.undescribed(walked) == [f"plain ({where})", f"inner.bare ({where})", f"items[].bare ({where})"]
    monkeypatch.setattr(docs, "configuration_sections", lambda: walked)
    named = r"configuration keys without a description \(a # comment on or above the field's line\): plain "
    with pytest.raises(ValueError, match=named + r".*inner\.bare .*items\[\]\.bare"):
        docs.render_configuration()
    with pytest.raises(PluginError, match=named):
        docs.on_pre_build(None)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped (letters of any
    script kept), each space a hyphen."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).lower()
    return "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN").replace(" ", "-")


def anchors(page: Path) -> tuple[set[str], set[str]]:
    """The anchors of a page's headings as MkDocs (python-markdown's toc) and GitHub make them."""
    headings = [line.lstrip("#").strip() for line in FENCE.sub("", page.read_text()).splitlines() if line[:1] == "#"]
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in headings}, {github_anchor(h) for h in headings}


def test_every_relative_link_resolves_on_the_repository_as_in_the_site():
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")]
    dead = []
    for page in pages:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto, data: not the repository's
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or ROOT not in file.parents:
                dead.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and not all(anchor in found for found in anchors(file)):
                dead.append(f"{page.relative_to(ROOT)}: {target} (no heading with that anchor on both)")
    assert len(pages) > 40 and not dead, "\n".join(dead)


def test_the_citation_file_names_the_project_and_the_papers_the_readme_cites():
    import yaml

    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    readme = (ROOT / "README.md").read_text()
    assert cff["cff-version"] == "1.2.0" and cff["license"] == "Apache-2.0"
    assert cff["version"] == re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    cited = {ref["title"]: [i["value"] for i in ref.get("identifiers", [])] for ref in cff["references"]}
    merit = "Decentralized Instruction Tuning: Conflict-Aware Splitting and Weight Merging"
    assert merit in readme.replace("\n", " ") and cited[merit] == ["arXiv:2606.01717"] and "2606.01717" in readme


def undocumented(parser, measurements: dict[str, str], reference: str, readme: str) -> list[str]:
    """What the docs lack: a ``merit`` command (a subparser of ``parser``) or one of its long
    options, or a ``merit bench`` measurement, missing from the CLI reference (each command as a
    code span that opens with ``merit NAME``); a command missing from the README's command table
    (the rows between ``## The command line`` and the next ``## `` heading), or a table whose
    ``merit bench NAME`` row does not list the measurements, in their order."""
    import argparse

    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = []
    for name, sub in subparsers.choices.items():
        if not re.search(rf"`merit {re.escape(name)}(?![\w-])", reference):
            missing.append(f"cli.md: merit {name}")
        options = sorted({s for a in sub._actions for s in a.option_strings if s.startswith("--") and s != "--help"})
        named = [o for o in options if re.search(rf"(?<![\w-]){o}(?![\w-])", reference)]
        missing += [f"cli.md: merit {name} {o}" for o in options if o not in named]
    missing += [f"cli.md: merit bench {m}" for m in measurements if f"`merit bench {m}" not in reference]
    section = readme.split("\n## The command line\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| `merit ")]
    commands = {re.match(r"`merit ([\w-]+)", cell)[1]: cell for cell in rows}
    missing += [f"README.md: merit {name}" for name in subparsers.choices if name not in commands]
    if "bench" in commands and re.findall(r"`([\w-]+)`", commands["bench"]) != list(measurements):
        missing.append(f"README.md: the merit bench row lists {list(measurements)} in that order")
    return missing


def test_every_command_and_measurement_is_in_the_cli_reference_and_the_readme_table():
    """docs/reference/cli.md names every ``merit`` command, each of its options and every ``merit
    bench`` measurement; the README's table has a row per command, and its bench row names the
    measurements. A command or measurement added without docs fails here, as the check on a parser
    with a command, an option and a measurement more shows."""
    import argparse

    from merit.bench import MEASUREMENTS
    from merit.cli import build_parser

    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    reference = (ROOT / "docs" / "reference" / "cli.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert {"run", "tune-merge", "bench"} <= set(subparsers.choices)
    assert {"experts", "sources", "mixture"} <= set(MEASUREMENTS)
    assert undocumented(parser, MEASUREMENTS, reference, readme) == []

    subparsers.add_parser("frobnicate").add_argument("--wobble")
    subparsers.choices["merge"].add_argument("--dry-run", action="store_true")
    more = {**MEASUREMENTS, "gadgets": "a measurement nobody documented"}
    assert undocumented(parser, more, reference, readme) == [
        "cli.md: merit merge --dry-run",
        "cli.md: merit frobnicate",
        "cli.md: merit frobnicate --wobble",
        "cli.md: merit bench gadgets",
        "README.md: merit frobnicate",
        f"README.md: the merit bench row lists {list(more)} in that order",
    ]


def test_the_readme_and_the_sites_home_tell_the_same_status():
    """One status table, in the same words on both pages (the README's links reach docs/)."""

    def status(text: str) -> str:
        section = text[text.index("## Status") :]
        return section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)].strip()

    readme = status((ROOT / "README.md").read_text()).replace("](docs/", "](")
    home = status((ROOT / "docs" / "index.md").read_text())
    assert readme == home and "Never run yet:" in home and "| what ran | machine | commit | results |" in home
