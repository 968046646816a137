"""Load a recipe: YAML file + ``key.sub=value`` overrides -> validated :class:`RunConfig`.

Every problem of a recipe is collected and raised together as one :class:`RecipeError`, each
line naming the dotted field path, the bad value and the fix. pydantic's own error list is folded
per field (a union such as ``int | 'auto'`` would otherwise give one error per member) and
rewritten in the same form as the cross-field checks of :mod:`memtrain.config.schema`.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

from memtrain import sources
from memtrain.config.base import MISSING
from memtrain.config.schema import Problem, RunConfig, cross_section_problems
from memtrain.config.suggest import did_you_mean, size_problem
from memtrain.errors import MemtrainError

_YAML_BOOL_WORDS = ("yes", "no", "on", "off", "y", "n")  # YAML 1.1 reads these bare words as booleans


class _StrictLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (PyYAML would keep only the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            first = seen.setdefault(key, key_node.start_mark.line + 1)
        except TypeError:  # an unhashable key: the constructor reports it
            continue
        if first != key_node.start_mark.line + 1:
            raise yaml.constructor.ConstructorError(
                None, None, f"the key {key!r} appears twice (first at line {first}); YAML would keep "
                "only the second, so merge them into one", key_node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

_TYPE_ERRORS = ("_parsing", "_type", "literal_error", "model_attributes_type", "dict_type")


class RecipeError(MemtrainError):
    """A recipe has one or more mistakes; ``problems`` lists them all."""

    def __init__(self, problems: Sequence[Problem], source: str = "recipe") -> None:
        self.problems = list(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        count = len(self.problems)
        super().__init__(f"{source}: {count} problem{'s' * (count != 1)}:\n{lines}")


def shipped_recipes_dir() -> Path:
    """The folder of recipes that ship with memtrain (repository checkout or installed wheel)."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "_recipes", here.parent / "recipes"):
        if candidate.is_dir():
            return candidate
    return here.parent / "recipes"


def resolve_recipe_path(recipe: str | Path) -> Path:
    """A recipe file path, or the name of a shipped recipe (``quickstart``)."""
    path = Path(recipe)
    if path.is_file():
        return path
    shipped = shipped_recipes_dir() / f"{path.stem}.yaml"
    if path.suffix in ("", ".yaml") and len(path.parts) == 1 and shipped.is_file():
        return shipped
    names = sorted(p.stem for p in shipped_recipes_dir().glob("*.yaml"))
    raise RecipeError(
        [Problem("recipe", str(recipe), "no such file",
                 f"give a path to a YAML recipe or one of the shipped recipes: {', '.join(names)}.")],
        source=str(recipe),
    )


def load_recipe(recipe: str | Path | dict, overrides: Sequence[str] = (), *,
                require: Sequence[str] | None = None) -> RunConfig:
    """Read, override and validate a recipe.

    Args:
        recipe: a YAML file path, a shipped recipe name, or an already-parsed mapping.
        overrides: ``key.sub=value`` strings; values are parsed as YAML (``3``, ``true``, ``[a, b]``).
        require: the fields naming files that must exist (default: all of them, model and data);
            a finished run's recipe, loaded for inference, needs only ``model.name``.

    Returns:
        The validated configuration; ``output.dir``'s ``{recipe}`` is filled in.

    Raises:
        RecipeError: every problem found, each with its field path and fix.
    """
    if isinstance(recipe, dict):
        data, source, stem = _deep_copy(recipe), "recipe", "recipe"
    else:
        path = resolve_recipe_path(recipe)
        data, source, stem = _read_yaml(path), str(path), path.stem
    problems: list[Problem] = []
    for item in overrides:
        problems.extend(_apply_override(data, item))
    if problems:
        raise RecipeError(problems, source)
    context: dict[str, Any] = {"problems": []}
    booleans = _booleans_for_numbers(data, RunConfig, "")
    flagged = {p.path for p in booleans}  # their value read as 0 or 1 may fail other checks too
    try:
        cfg = RunConfig.model_validate(data, context=context)
    except ValidationError as err:
        found = booleans + [p for p in _fold_errors(err) + context["problems"] if p.path not in flagged]
        raise RecipeError(found + _cross_checks_of_valid_sections(data, found), source) from None
    missing = [p for p in _check_sources(cfg) if require is None or p.path in require]
    problems = booleans + [p for p in context["problems"] + missing if p.path not in flagged]
    if problems:
        raise RecipeError(problems, source)
    cfg.output.dir = cfg.output.dir.replace("{recipe}", stem)
    return cfg


def _cross_checks_of_valid_sections(data: dict, found: list[Problem]) -> list[Problem]:
    """The checks across sections, run on the sections that are valid on their own.

    pydantic skips the root model's checks when any section fails; this still reports, say,
    quantization with full fine-tuning when only `training` has a typo. Checks that involve a
    broken section are skipped.
    """
    sections: dict[str, Any] = {}
    for name, field in RunConfig.model_fields.items():
        model = section_model(field.annotation)
        if model is None or any(p.path.split(".")[0] == name for p in found):
            continue
        raw = data.get(name)
        if raw is None and field.is_required():
            continue
        try:
            sections[name] = model.model_validate(raw or {}, context={"problems": []})
        except ValidationError:
            continue
    return [p for p in cross_section_problems(sections) if p not in found]


def _booleans_for_numbers(data: Any, model: type[BaseModel], prefix: str) -> list[Problem]:
    """true/false where a number belongs (pydantic would read them as 1 and 0)."""
    if not isinstance(data, dict):
        return []
    found: list[Problem] = []
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue
        sub = section_model(field.annotation)
        kinds = _flatten(field.annotation)
        if isinstance(value, dict) and sub is not None:
            found += _booleans_for_numbers(value, sub, f"{prefix}{key}.")
        elif isinstance(value, list) and sub is not None:  # a list of mappings (data.mix)
            for i, item in enumerate(value):
                found += _booleans_for_numbers(item, sub, f"{prefix}{key}[{i}].")
        elif isinstance(value, bool) and bool not in kinds and (int in kinds or float in kinds):
            found.append(Problem(f"{prefix}{key}", value, f"expected {describe_type(field.annotation)}",
                                 f"set it to {describe_type(field.annotation)} (true and false are "
                                 "not numbers here)."))
    return found


def dump_recipe(cfg: RunConfig) -> str:
    """The fully resolved recipe as YAML (what a run actually used)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, width=100)


def _check_sources(cfg: RunConfig) -> list[Problem]:
    """Local files and package folders must exist; hub ids are taken on trust (no network)."""
    from memtrain.builtin_data import BUILTINS

    problems = []
    data = [(d.key("source"), d.source) for d in cfg.data.datasets()]
    for path, value in (("model.name", cfg.model.name), ("model.tokenizer", cfg.model.tokenizer), *data):
        if value is None:
            continue
        if value.startswith("builtin:"):
            name = value.removeprefix("builtin:")
            if not path.startswith("data.") or name not in BUILTINS:
                problems.append(Problem(path, value, "is not a built-in dataset",
                                        f"use one of: {', '.join('builtin:' + b for b in BUILTINS)}."))
            continue
        try:
            sources.resolve(value)
        except FileNotFoundError as err:
            problems.append(Problem(path, value, f"cannot be found ({err})",
                                    "check the path (relative paths start from the current "
                                    "directory), or install the package that ships it."))
    return problems


# ----------------------------------------------------------------------------- reading + overrides


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)  # a SafeLoader
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RecipeError(
            [Problem("recipe", MISSING, f"is not valid YAML{where}: {problem}",
                     "fix the YAML syntax (indentation, quotes, `key: value`).")], str(path)
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError([Problem("recipe", str(path), f"cannot be read ({err})", "")]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            [Problem("recipe", type(data).__name__, "must be a mapping of sections",
                     "start the file with `model:`, `data:`, ... sections.")], str(path)
        )
    return data


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def _apply_override(data: dict, item: str) -> list[Problem]:
    """Set ``a.b.c=value`` in ``data``; returns the problems instead of raising."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        return [Problem("override", item, "must look like `section.key=value`",
                        "write e.g. `training.learning_rate=1e-4`.")]
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML: keep the text, the schema will judge it
    if isinstance(value, bool) and raw.strip().lower() in _YAML_BOOL_WORDS:
        value = raw.strip()  # `save_strategy=no` means the word; a boolean field reads "no" as false
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None or child == "auto":
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            return [Problem(where, child, f"is a value, so `{key}` cannot be set inside it",
                            f"override `{where}=...` directly.")]
        node = child
    node[parts[-1]] = value
    return []


# -------------------------------------------------------------------------- pydantic -> Problems


def _fold_errors(err: ValidationError) -> list[Problem]:
    """One Problem per field path, from pydantic's per-union-member error list."""
    groups: dict[str, list[dict]] = {}
    fields: dict[str, Any] = {}
    for e in err.errors():
        path, field = _field_path(e)
        groups.setdefault(path, []).append(e)
        fields[path] = field
    return [_to_problem(path, errs, fields[path]) for path, errs in groups.items()]


def _field_path(error: dict) -> tuple[str, Any]:
    """Map pydantic's loc (with union member tags) to the dotted recipe path and its FieldInfo."""
    model: Any = RunConfig
    parts: list[str] = []
    field = None
    loc = list(error["loc"])
    for i, part in enumerate(loc):
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif isinstance(model, type) and issubclass(model, BaseModel):
            if part in model.model_fields:
                field = model.model_fields[part]
                parts.append(part)
                model = section_model(field.annotation)
            elif error["type"] == "extra_forbidden" and i == len(loc) - 1:
                parts.append(part)
                field = ("extra", model)
        elif model is None and field is not None and not _is_union_tag(part):
            parts.append(str(part))  # a key inside a free-form dict
    return ".".join(parts).replace(".[", "["), field


def _is_union_tag(part: str) -> bool:
    return any(ch in part for ch in "[(") or part in ("int", "str", "float", "bool", "none")


def section_model(annotation: Any) -> type[BaseModel] | None:
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _to_problem(path: str, errors: list[dict], field: Any) -> Problem:
    first = errors[0]
    value = first.get("input", MISSING)
    kind = first["type"]
    if kind == "extra_forbidden":
        valid = list(field[1].model_fields)
        section, _, key = path.rpartition(".")
        sections = {name: m for name, f in RunConfig.model_fields.items()
                    if (m := section_model(f.annotation)) is not None}
        hint = did_you_mean(key, valid, sections, section)
        return Problem(path, MISSING, "unknown key", f"{hint}Valid keys here: {', '.join(valid)}.")
    if kind == "missing":
        return Problem(path, MISSING, "is required", f"add it: {field.description}")
    constraint = [e for e in errors if not any(t in e["type"] for t in _TYPE_ERRORS)]
    if constraint:
        msg = constraint[0]["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
        about = f" ({field.description.rstrip('.')})" if field is not None and field.description else ""
        return Problem(path, constraint[0].get("input", value), msg[0].lower() + msg[1:],
                       f"choose a value that satisfies this{about}.")
    size = size_problem(path, value)
    if size is not None:
        return size
    expected = describe_type(field.annotation) if field is not None else "another value"
    item = section_model(field.annotation) if field is not None and path.endswith("]") else None
    if item is not None:  # an entry of a list of mappings (data.mix[i])
        expected = describe_type(item)
    fix = f"set it to {expected}."
    options = _literals(field.annotation) if field is not None else []
    close = difflib.get_close_matches(str(value), options, n=1) if options else []
    if close:
        fix = f"did you mean {close[0]!r}? Allowed: {', '.join(map(repr, options))}."
    words = [o for o in options if o.lower() in _YAML_BOOL_WORDS]
    if isinstance(value, bool) and words:
        fix = (f"YAML reads a bare {words[0]} as {str(value).lower()}: write it in quotes, "
               f"`{path.rsplit('.', 1)[-1]}: \"{words[0]}\"`.")
    return Problem(path, value, f"expected {expected}", fix)


def _literals(annotation: Any) -> list[str]:
    out: list[str] = []
    for arg in _flatten(annotation):
        if typing.get_origin(arg) is Literal:
            out.extend(str(a) for a in typing.get_args(arg))
    return out


def _flatten(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(annotation) for a in _flatten(arg)]
    return [annotation]


def describe_type(annotation: Any) -> str:
    """Human wording of a type: ``int | Literal['auto'] | None`` -> "an integer, 'auto' or null"."""
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
             type(None): "null"}
    words: list[str] = []
    for arg in _flatten(annotation):
        origin = typing.get_origin(arg)
        if origin is Literal:
            words.extend(repr(a) for a in typing.get_args(arg))
        elif origin is list:
            words.append("a list of mappings" if section_model(arg) else "a list")
        elif origin is dict:
            words.append("a mapping")
        elif isinstance(arg, type) and issubclass(arg, BaseModel):
            words.append(f"a mapping of {', '.join(arg.model_fields)}")
        else:
            words.append(names.get(arg, getattr(arg, "__name__", str(arg))))
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
