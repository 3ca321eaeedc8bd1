"""The documentation's pages generated from the code, and the MkDocs hook that checks them.

- ``reference/configuration.md``, from ``pipeline.config.RunConfig``: every key (sections, lists of
  sections and their items walked recursively) with its type, its default, and the comment
  written beside it in the source (``#`` comments on or above the field line, class docstrings),
  read with ``ast`` and ``tokenize``.
- ``reference/merge-spec.md``, the same for ``pipeline.merge.spec.MergeSpec`` (``merit merge``'s YAML).

Both are committed, so that they read on the repository as in the site: ``make reference`` (or
``python docs/hooks.py``) writes them, and the build (mkdocs.yml ``hooks:``) fails when a
committed page differs from what the code gives, so it cannot drift from the code. Both fail too,
naming the keys, where a key has no description (no comment beside its field).
``tests/test_docs.py`` builds the site with ``mkdocs build --strict``.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = "reference/configuration.md"
MERGE_SPEC = "reference/merge-spec.md"


# --- comments and docstrings from the source -------------------------------------------------


@cache
def _source_comments(path: str) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """Per class of the file: {field: its comment}; and {class: its docstring}."""
    source = Path(path).read_text()
    lines = source.splitlines()
    comments: dict[int, tuple[bool, str]] = {}  # line -> (standalone, text)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            standalone = not lines[row - 1][:col].strip()
            comments[row] = (standalone, tok.string.lstrip("#").strip())
    fields: dict[str, dict[str, str]] = {}
    docs: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        docs[node.name] = ast.get_docstring(node) or ""
        found: dict[str, str] = {}
        previous: tuple[str, str, int] | None = None  # (field, its trailing comment, its last line)
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                previous = None
                continue
            above, row = [], stmt.lineno - 1
            while row in comments and comments[row][0]:
                above.insert(0, comments[row][1])
                row -= 1
            trailing = " ".join(
                comments[r][1] for r in range(stmt.lineno, stmt.end_lineno + 1) if r in comments and not comments[r][0]
            )
            # A trailing comment that stops mid-sentence (";" or ",") goes on over the lines below it.
            if previous and above and previous[1].endswith((";", ",")) and row == previous[2]:
                name, text, _ = previous
                found[name] = f"{text} {' '.join(above)}"
                above = []
            found[stmt.target.id] = " ".join([*above, trailing]).strip()
            previous = (stmt.target.id, trailing, stmt.end_lineno)
        fields[node.name] = found
    return fields, docs


def _origin_class(model: type[BaseModel], field: str) -> type[BaseModel]:
    """The class of ``model``'s MRO whose own body declares ``field``."""
    for cls in model.__mro__:
        if field in inspect.get_annotations(cls):
            return cls
    return model


def field_comment(model: type[BaseModel], field: str) -> str:
    cls = _origin_class(model, field)
    fields, _ = _source_comments(inspect.getsourcefile(cls))
    return _markdown(fields.get(cls.__name__, {}).get(field, ""))


def class_doc(model: type[BaseModel]) -> str:
    _, docs = _source_comments(inspect.getsourcefile(model))
    return _markdown(" ".join(docs.get(model.__name__, "").split()))


def _markdown(text: str) -> str:
    """One line of markdown: reStructuredText's ``code`` as `code`, and outside code, < and > as
    text (``merged/<name>`` is no HTML tag)."""
    text = re.sub(r"``(.+?)``", r"`\1`", " ".join(text.split()))
    parts = text.split("`")
    parts[::2] = [p.replace("<", "&lt;").replace(">", "&gt;") for p in parts[::2]]
    return "`".join(parts)


# --- types and defaults ----------------------------------------------------------------------


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(the type without ``None``, whether ``None`` is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), True  # noqa: UP007
    return tp, False


def nested(tp: Any) -> tuple[type[BaseModel] | None, bool]:
    """The section a field holds (itself, or as the items of a list), and whether it is a list."""
    tp, _ = _unwrap(tp)
    if _is_model(tp):
        return tp, False
    if typing.get_origin(tp) is list and _is_model(typing.get_args(tp)[0]):
        return typing.get_args(tp)[0], True
    return None, False


NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", Any: "any"}


def type_text(tp: Any) -> str:
    tp, optional = _unwrap(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        text = "one of " + ", ".join(f"`{a}`" for a in args)
    elif origin in (typing.Union, types.UnionType):
        text = ", or ".join(type_text(a) for a in args)
    elif origin is list:
        text = f"list of {type_text(args[0])}"
        text = text if " " not in type_text(args[0]) else f"list of ({type_text(args[0])})"
    elif origin is dict:
        text = f"map of {type_text(args[0])} to {type_text(args[1])}"
    elif origin is tuple:
        text = "[" + ", ".join(type_text(a) for a in args) + "]"
    elif _is_model(tp):
        text = "section"
    else:
        text = NAMES.get(tp, getattr(tp, "__name__", str(tp)))
    return f"{text}, or null" if optional else text


def constraints(info: Any) -> str:
    marks = []
    for m in info.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                marks.append(f"{sign} {getattr(m, attr)}")
        if getattr(m, "pattern", None):
            marks.append(f"matches `{m.pattern}`")
    return ", ".join(marks)


def _flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6).strip().removesuffix("...")


def default_text(info: Any) -> str:
    if info.default is PydanticUndefined and info.default_factory is None:
        return "required"
    value = info.default_factory() if info.default is PydanticUndefined else info.default
    if isinstance(value, BaseModel):
        return "(the section's defaults)"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        value = [v.model_dump(mode="json", exclude_unset=True) for v in value]
    elif isinstance(value, tuple):
        value = list(value)
    return f"`{_flow(value).strip()}`"


# --- the page ---------------------------------------------------------------------------------


def anchor(path: str) -> str:
    """The anchor of the heading `` `path` `` as MkDocs and GitHub both make it (dots and brackets dropped)."""
    return re.sub(r"[^a-z0-9_-]", "", path.lower())


def sections(model: type[BaseModel], path: str) -> list[tuple[str, type[BaseModel]]]:
    """(path, section) of ``model`` and of every section inside it, depth first; list items as ``[]``."""
    out = [(path, model)]
    for name, info in model.model_fields.items():
        inner, is_list = nested(info.annotation)
        if inner is not None:
            out += sections(inner, (f"{path}.{name}" if path else name) + ("[]" if is_list else ""))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def undescribed(walked: list[tuple[str, type[BaseModel]]]) -> list[str]:
    """The keys of these sections whose field has no comment, each with the file that declares it."""
    missing = []
    for path, model in walked:
        for name in model.model_fields:
            if not field_comment(model, name):
                source = Path(inspect.getsourcefile(_origin_class(model, name))).resolve()
                where = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
                missing.append(f"{f'{path}.{name}' if path else name} ({where})")
    return missing


def require_descriptions(what: str, walked: list[tuple[str, type[BaseModel]]]) -> None:
    """Refuse a reference with an empty "what it is": every key gets a ``#`` comment."""
    if missing := undescribed(walked):
        raise ValueError(
            f"{what} keys without a description (a # comment on or above the field's line): {', '.join(missing)}"
        )


def configuration_sections() -> list[tuple[str, type[BaseModel]]]:
    """The sections of the configuration reference: each top-level section of ``RunConfig``, walked."""
    from pipeline.config import RunConfig

    return [s for name, info in RunConfig.model_fields.items() for s in sections(info.annotation, name)]


def merge_spec_sections() -> list[tuple[str, type[BaseModel]]]:
    from pipeline.merge.spec import MergeSpec

    return sections(MergeSpec, "")


def table(model: type[BaseModel], path: str) -> list[str]:
    rows = ["| key | type | default | what it is |", "| --- | --- | --- | --- |"]
    for name, info in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        inner, is_list = nested(info.annotation)
        kind = type_text(info.annotation)
        if inner is not None:
            target = key + ("[]" if is_list else "")
            kind = ("list of sections" if is_list else "section") + (", or null" if "null" in kind else "")
            kind += f": [keys below](#{anchor(target)})"
        limits = constraints(info)
        kind += f" ({limits})" if limits else ""
        rows.append(f"| `{key}` | {_cell(kind)} | {_cell(default_text(info))} | {_cell(field_comment(model, name))} |")
    return rows


def render_configuration() -> str:
    require_descriptions("configuration", configuration_sections())
    lines = [
        "# Configuration reference",
        "",
        "<!-- Written by docs/hooks.py (make reference) from pipeline/config.py: edit the code, not this page. -->",
        "",
        "One YAML file, validated by pydantic (`pipeline/config.py`, `RunConfig`). An unknown key or a bad",
        "value is an error that names the key (`data.max_lenght: Extra inputs are not permitted`); a key",
        "left out takes its default. `--set KEY=VALUE` overrides any key from the command line, the value",
        "parsed as YAML: `--set train.lr=2e-5`, `--set data.sources.0.max_examples=100` (a list item by",
        "its index), `--set 'eval.benchmarks=[toy_perception, toy_diagram]'`. A run directory keeps the",
        "resolved config as `config.yaml`.",
        "",
        "This page is generated from the code (the build fails when it is not current): every key, its type,",
        "its default and the comment written beside it. `[]` stands for each item of a list",
        "(`data.sources[].path`: the `path` of every source).",
        "",
    ]
    for path, model in configuration_sections():
        lines += [f"{'###' if '.' in path else '##'} `{path}`", ""]
        doc = class_doc(model)
        lines += [doc, ""] if doc else []
        lines += [*table(model, path), ""]
    return "\n".join(lines)


def render_merge_spec() -> str:
    require_descriptions("merge spec", merge_spec_sections())
    lines = [
        "# Merge spec reference",
        "",
        "<!-- Written by docs/hooks.py (make reference) from pipeline/merge/spec.py: edit the code, not this page. -->",
        "",
        "The YAML file `merit merge SPEC.yaml` reads (`pipeline/merge/spec.py`, `MergeSpec`), generated from",
        "the code like [the configuration reference](configuration.md). Unknown keys are errors; `[]` stands",
        "for each item of a list. How to use it: [the merge library alone](../guides/merge-library.md).",
        "",
    ]
    for path, model in merge_spec_sections():
        lines += [f"## `{path}`" if path else "## The spec", ""]
        doc = class_doc(model)
        lines += [doc, ""] if doc else []
        lines += [*table(model, path), ""]
    return "\n".join(lines)


# --- the pages, written and checked ---------------------------------------------------------------

DOCS = Path(__file__).resolve().parent
GENERATED = {REFERENCE: render_configuration, MERGE_SPEC: render_merge_spec}


def stale_pages() -> list[str]:
    """The generated pages whose committed text is not what the code gives now."""
    return [page for page, render in GENERATED.items() if (DOCS / page).read_text() != render() + "\n"]


def on_pre_build(config):
    from mkdocs.exceptions import PluginError

    try:
        stale = stale_pages()
    except ValueError as err:  # a key without a description (require_descriptions)
        raise PluginError(str(err)) from None
    if stale:
        raise PluginError(f"{', '.join(stale)} not current with the code: run `make reference`")


if __name__ == "__main__":
    for page, render in GENERATED.items():
        (DOCS / page).write_text(render() + "\n")
        print(f"wrote docs/{page}")
