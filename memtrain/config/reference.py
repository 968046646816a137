"""The recipe reference (docs/RECIPES.md), generated from the schema so it cannot drift."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from memtrain.config.loader import describe_type, section_model
from memtrain.config.schema import RunConfig

HEADER = """# Recipe reference

Generated from `memtrain/config/schema.py` by `python -m scripts.tools.gen_docs`; do not edit by hand.

A recipe is a YAML file with the sections below. Every key is optional unless its default says
*required*. Any key can be overridden on the command line after the recipe path, as
`section.key=value` (the value is read as YAML: `3`, `true`, `[a, b]`, `null`):

    memtrain train recipes/quickstart.yaml training.learning_rate=5e-4 data.max_examples=2000
"""


def render_reference(after: dict[str, str] | None = None) -> str:
    """Markdown: one table per section, with each key's type, default and help; ``after`` adds text
    after a section (``scripts/tools/gen_docs.py`` adds the registered techniques after ``memory``)."""
    parts = [HEADER]
    for name, field in RunConfig.model_fields.items():
        section = section_model(field.annotation)
        if section is None:
            parts.append(f"## `{name}`\n\n{field.description} Type: {describe_type(field.annotation)}.\n")
            continue
        parts.append(_section(name, section))
        if after and name in after:
            parts.append(after[name])
    return "\n".join(parts)


def _section(prefix: str, model: type[BaseModel]) -> str:
    lines = [f"## `{prefix}`", "", (model.__doc__ or "").strip(), "",
             "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    nested: list[str] = []
    for key, field in model.model_fields.items():
        inner = section_model(field.annotation)
        if inner is not None and field.default_factory is inner:
            nested.append(_section(f"{prefix}.{key}", inner))
            continue
        lines.append(f"| `{key}` | {describe_type(field.annotation)} | {_default(field)} | "
                     f"{(field.description or '').replace('|', '/')} |")
        if inner is not None:
            nested.append(_section(f"{prefix}.{key}", inner))
    return "\n".join(lines) + "\n" + "".join("\n" + n for n in nested)


def _default(field: Any) -> str:
    if field.is_required():
        return "*required*"
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is PydanticUndefined:
        return "*required*"
    if isinstance(value, BaseModel):
        return "see below"
    if isinstance(value, str) and "\n" not in value:
        return f"`{value}`"
    return f"`{value!r}`"  # repr keeps a multi-line default on one table row
