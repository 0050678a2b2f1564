"""Configuration reference: every key of a pydantic config tree as Markdown tables.

One table per section (a field holding a nested model); each row is a dotted key with its type
(allowed values of a Literal listed, Optional shown as "or null", numeric bounds), its default
("required" when there is none) and its description.

Descriptions come from pydantic (`Field(description=...)`, or attribute docstrings where a model
sets `use_attribute_docstrings`) and otherwise from the attribute docstrings themselves, read
from the class source with `ast` the way pydantic does: the string literal right after a field.
Comments are never read.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any

import annotated_types
import yaml
from mdtext import code, prose, slug, table
from pydantic import BaseModel
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class ConfigRoot:
    """One config tree to document: a heading, the root model, and an id prefix for anchors
    (two trees may both have a section called `models`)."""

    title: str
    model: type[BaseModel]
    anchor_prefix: str = ""
    intro: str = ""


@dataclass(frozen=True)
class KeyRow:
    key: str
    type: str
    default: str
    description: str


@functools.cache
def attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it, for `cls` and its bases (read-only)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or klass.__module__.startswith("pydantic"):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        tree = ast.parse(source)
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def class_doc(cls: type) -> str:
    """The class's own docstring (not an inherited one), or ''."""
    doc = cls.__dict__.get("__doc__")
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    if _is_union(annotation):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) < len(typing.get_args(annotation)) and len(args) == 1:
            return args[0], True
    return annotation, False


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _model_class(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _map_value_model(annotation: Any) -> type[BaseModel] | None:
    """`dict[str, SomeModel]` -> SomeModel."""
    if typing.get_origin(annotation) is dict:
        args = typing.get_args(annotation)
        if len(args) == 2:
            return _model_class(args[1])
    return None


def _list_item_model(annotation: Any) -> type[BaseModel] | None:
    """`list[SomeModel]` -> SomeModel."""
    if typing.get_origin(annotation) is list:
        args = typing.get_args(annotation)
        if len(args) == 1:
            return _model_class(args[0])
    return None


def yaml_value(value: Any) -> str:
    """A default as it would be written in the YAML file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # Quote only what YAML would read as something else (e.g. "null", "1.0", "").
        plain = yaml.safe_load(value) == value and value.strip() == value
        return value if plain else json.dumps(value)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, BaseModel):
        return yaml_value(value.model_dump(mode="json"))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def type_label(annotation: Any) -> str:
    """A readable type: `int`, `str or null`, one of `a`, `b`, `list[int]`."""
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return code("any")
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        values = ", ".join(code(yaml_value(v)) for v in typing.get_args(annotation))
        return f"one of {values}"
    if _is_union(annotation):
        args = typing.get_args(annotation)
        parts = [type_label(a) for a in args if a is not type(None)]
        if type(None) in args:
            parts.append("null")
        return " or ".join(parts)
    if origin in (list, tuple, dict, set):
        args = typing.get_args(annotation)
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            args = args[:1]
        if len(args) == 1 and typing.get_origin(args[0]) is typing.Literal:
            return f"list of {type_label(args[0])}"
        inner = ", ".join(_plain_type(a) for a in args)
        return code(f"{origin.__name__}[{inner}]" if args else origin.__name__)
    return code(_plain_type(annotation))


def _plain_type(annotation: Any) -> str:
    if annotation is Any:
        return "Any"
    if isinstance(annotation, type) and typing.get_origin(annotation) is None:
        return annotation.__name__
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "|".join(yaml_value(v) for v in typing.get_args(annotation))
    if _is_union(annotation):
        return " | ".join(_plain_type(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_plain_type(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return str(annotation)


_BOUNDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.MinLen, "min_length", "length ≥"),
    (annotated_types.MaxLen, "max_length", "length ≤"),
)


def bounds_label(field: FieldInfo) -> str:
    """Numeric and length bounds of a field, e.g. `> 0, ≤ 1`."""
    parts = []
    for meta in field.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                parts.append(f"{sign} {yaml_value(getattr(meta, attr))}")
    return ", ".join(parts)


def default_label(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    return code(yaml_value(value))


def _description(field: FieldInfo, docs: dict[str, str], name: str) -> str:
    return field.description or docs.get(name, "")


def key_rows(
    model: type[BaseModel],
    prefix: str = "",
    owners: dict[type, str] | None = None,
    names: list[str] | None = None,
) -> list[KeyRow]:
    """Rows for every key under `model` (or only its fields `names`), nested models expanded
    as dotted keys.

    `owners` maps a model class to the key where it was first expanded: a map of such models
    (`models: dict[str, ModelServeConfig]`) then points there instead of repeating its keys.
    """
    owners = {} if owners is None else owners
    owners.setdefault(model, prefix.rstrip("."))
    docs = attribute_docstrings(model)
    rows: list[KeyRow] = []
    for name in names if names is not None else list(model.model_fields):
        field = model.model_fields[name]
        key = f"{prefix}{name}"
        annotation, optional = _strip_optional(field.annotation)
        description = _description(field, docs, name)
        sub = _model_class(annotation)
        mapped = _map_value_model(annotation)
        item = _list_item_model(annotation)
        if sub is not None:
            section_doc = class_doc(sub)
            if optional:  # the section itself is a setting: null switches it off
                label = f"section ({sub.__name__}) or null"
                text = " ".join(t for t in (description, section_doc) if t)
                rows.append(KeyRow(key, label, default_label(field), text))
            rows.extend(key_rows(sub, f"{key}.", owners))
        elif mapped is not None:
            label = f"map of name to section ({mapped.__name__})"
            owner = owners.get(mapped)
            if owner is not None:
                see = f"Each entry takes the keys listed under {code(owner)}."
                description = f"{description} {see}".strip()
            rows.append(KeyRow(key, label, default_label(field), description))
            if owner is None:
                rows.extend(key_rows(mapped, f"{key}.<name>.", owners))
        elif item is not None:
            label = f"list of sections ({item.__name__})" + (" or null" if optional else "")
            rows.append(KeyRow(key, label, default_label(field), description))
            rows.extend(key_rows(item, f"{key}[].", owners))
        else:
            label = type_label(field.annotation)
            bounds = bounds_label(field)
            if bounds:
                label = f"{label}, {bounds}"
            rows.append(KeyRow(key, label, default_label(field), description))
    return rows


def _rows_table(rows: list[KeyRow]) -> str:
    cells = [[code(r.key), r.type, r.default, prose(r.description)] for r in rows]
    return table(["Key", "Type", "Default", "Description"], cells)


def render_root(root: ConfigRoot) -> str:
    """One config tree: a heading, then a table of its top-level keys and one per section."""
    out = [f"## {root.title} {{#{slug(root.anchor_prefix + 'config')}}}", ""]
    if root.intro:
        out += [root.intro, ""]
    doc = class_doc(root.model)
    if doc:
        out += [prose(doc), ""]
    docs = attribute_docstrings(root.model)
    owners: dict[type, str] = {root.model: ""}
    top: list[KeyRow] = []
    sections: list[tuple[str, str, list[KeyRow]]] = []
    for name, field in root.model.model_fields.items():
        annotation, _ = _strip_optional(field.annotation)
        sub = _model_class(annotation)
        mapped = _map_value_model(annotation)
        if sub is None and mapped is None:
            top.extend(key_rows(root.model, "", owners, [name]))
            continue
        rows = key_rows(root.model, "", owners, [name])
        texts = (_description(field, docs, name), class_doc(sub or mapped))
        intro = " ".join(t for t in texts if t)
        sections.append((name, intro, rows))
    if top:
        out += [f"### Top-level keys {{#{slug(root.anchor_prefix + 'top-level')}}}", ""]
        out += [_rows_table(top), ""]
    for name, intro, rows in sections:
        out += [f"### {name} {{#{slug(root.anchor_prefix + name)}}}", ""]
        if intro:
            out += [prose(intro), ""]
        out += [_rows_table(rows), ""]
    return "\n".join(out)


def render_config_reference(roots: list[ConfigRoot]) -> str:
    """The whole generated part of the configuration reference page."""
    return "\n".join(render_root(root) for root in roots).rstrip() + "\n"
