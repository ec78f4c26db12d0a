"""The configuration reference, docs/configuration.md, rendered from the config models.

Invariant: the text is a pure function of the models in config/schema.py (their order, types,
constraints, defaults, descriptions and RESUMABLE marks), so the checked-in file can be compared
with it (tests/unit/test_config_docs.py); regenerate it with
`python -m relayrl.config.docs > docs/configuration.md`.
"""

from __future__ import annotations

import sys
import types
from typing import Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from relayrl.config.schema import _toml_value, config_keys, is_resumable

REGENERATE = "python -m relayrl.config.docs > docs/configuration.md"

_HEADER = f"""\
# Configuration

<!-- Generated from src/relayrl/config/schema.py by `{REGENERATE}`;
do not edit by hand: tests/unit/test_config_docs.py checks that this file equals the generated text. -->

A recipe is a TOML file with one table per section below (`[run]`, `[task]`, ...); `relayrl train
--set section.key=value` overrides one key (repeatable). A key left out takes its default; an unknown
key, a value of the wrong type or outside its range is refused before the run starts, in one line
naming the key. The resolved configuration is written to the run directory as `config.toml`.

**Resumable**: whether `relayrl train --resume RUN_DIR --set section.key=value` may change the key.
Resumable keys decide how a run is hosted, logged, checkpointed, evaluated or how long it goes on,
never what a step computes; a resume that changes any other key is refused (the steps already
trained used the recorded value), and each accepted change is recorded in the run directory's
`config_changes.jsonl`.
"""

_NAMES: dict[object, str] = {bool: "boolean", int: "integer", float: "float", str: "string"}
_PLURALS: dict[object, str] = {bool: "booleans", int: "integers", float: "floats", str: "strings"}


def _type_name(annotation: object, plural: bool = False) -> str:
    """A field's type as a recipe writer reads it: TOML's names, the choices of a Literal."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return ("any of " if plural else "one of ") + ", ".join(_toml_value(a) for a in args)
    if origin in (Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        name = " or ".join(_type_name(a, plural) for a in present)
        return f"{name} (optional)" if len(present) < len(args) else name
    if origin is list:
        return f"list of {_type_name(args[0], plural=True)}" if args else "list"
    if origin is dict:
        value = args[1] if len(args) == 2 else object
        return "table" if value is object else f"table of {_type_name(value, plural=True)}"
    if _table_model(annotation) is not None:
        return "tables" if plural else "table"
    names = _PLURALS if plural else _NAMES
    if annotation in names:
        return names[annotation]
    raise TypeError(f"config/docs.py: no name for the type {annotation!r}; add one")


def _table_model(annotation: object) -> type[BaseModel] | None:
    """The model of a key that is itself a table of keys (e.g. train.lora), optional or not."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        models = [m for m in map(_table_model, get_args(annotation)) if m is not None]
        return models[0] if len(models) == 1 else None
    return None


def _row(key: str, field: FieldInfo) -> str:
    kind = _type_name(field.annotation)
    bounds = _constraints(field)
    row = [
        f"`{key}`",
        _cell(f"{kind}, {bounds}" if bounds else kind),
        _cell(_default(field)),
        "yes" if is_resumable(field) else "no",
        _cell(field.description or ""),
    ]
    return "| " + " | ".join(row) + " |"


def _constraints(field: FieldInfo) -> str:
    """The bounds pydantic checks (`≥ 1`, `< 1`, `at least 1 entry`), joined."""
    parts: list[str] = []
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge):
            parts.append(f"≥ {m.ge}")
        elif isinstance(m, annotated_types.Gt):
            parts.append(f"> {m.gt}")
        elif isinstance(m, annotated_types.Le):
            parts.append(f"≤ {m.le}")
        elif isinstance(m, annotated_types.Lt):
            parts.append(f"< {m.lt}")
        elif isinstance(m, annotated_types.MinLen):
            parts.append(f"at least {m.min_length} {'entry' if m.min_length == 1 else 'entries'}")
        else:
            raise TypeError(f"config/docs.py: no text for the constraint {m!r}; add one")
    return ", ".join(parts)


def _default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    return "unset" if value is None else f"`{_toml_value(value)}`"


def _cell(text: str) -> str:
    """One table cell: the text on one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _section_doc(model: type[BaseModel]) -> str:
    doc = model.__doc__
    if not doc:
        raise TypeError(f"config/docs.py: the section model {model.__name__} has no docstring")
    return " ".join(doc.split())


def render_markdown() -> str:
    """docs/configuration.md: every section and key of `Config` with its type (and bounds),
    default, whether a resume may change it, and its description."""
    sections: dict[str, tuple[type[BaseModel], list[str]]] = {}
    tables: dict[str, tuple[type[BaseModel], list[str]]] = {}  # a key that is a table of keys: its own section, after
    for section, model, key, field in config_keys():
        if not field.description:
            raise TypeError(f"config/docs.py: {section}.{key} has no description (a docstring under the field)")
        sections.setdefault(section, (model, []))[1].append(_row(key, field))
        sub = _table_model(field.annotation)
        if sub is not None:
            rows = tables.setdefault(f"{section}.{key}", (sub, []))[1]
            for name, subfield in sub.model_fields.items():
                if not subfield.description:
                    raise TypeError(f"config/docs.py: {section}.{key}.{name} has no description (a docstring under the field)")
                rows.append(_row(name, subfield))
    sections.update(tables)
    out = [_HEADER]
    out.append("Sections: " + ", ".join(f"[`[{name}]`](#{name.replace('.', '')})" for name in sections) + ".\n")
    for name, (model, rows) in sections.items():
        out.append(f"## [{name}]\n")
        out.append(_section_doc(model) + "\n")
        out.append("| key | type | default | resumable | description |")
        out.append("|---|---|---|---|---|")
        out.extend(rows)
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
