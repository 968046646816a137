"""No private attribute of torch / transformers / trl / peft / accelerate / torchao outside
``memtrain/_compat/`` (issue 35, part 1; docs/architecture.md, layer 0).

What counts as private use, found in the source (AST) of every module under ``memtrain/`` but
``_compat/``:

(a) an import of a private module of those libraries (a dotted component starting with ``_``:
    ``torch._C``, ``torch.distributed._tools``, ``torch._subclasses``, ``torch.utils._pytree``) or of
    a private name from one (``from torch.distributed._tools.mem_tracker import _MemRefType``);
(b) an attribute ``x._name`` (or ``getattr``/``setattr``/``hasattr``/``delattr`` of ``"_name"``):
    on a name imported from those libraries, always; on anything else (a local, an argument,
    ``self``, ``super()``), unless ``_name`` is memtrain's own (defined or assigned in memtrain outside
    ``_compat``, or starting with ``_memtrain``) and not a private attribute of the library classes
    memtrain works with;
(c) a method named ``_x`` defined in a class one of whose library bases (in its MRO) has ``_x``:
    an override of a private hook (found by importing the module);
(d) an assignment to an attribute of something imported from those libraries (a process-wide
    patch: ``PreTrainedModel.initialize_weights = ...``, ``setattr(masking_utils, ...)``).

``ALLOWED`` names what is left, each explicitly: an entry may only leave it; a new private use fails.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent.parent / "memtrain"
LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "torchao")
ATTR_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")

# Private uses left outside memtrain/_compat, each named: "path: what" -> how many. May only shrink.
ALLOWED: dict[str, int] = {
    # A public function (torch.compile) replaced while a module executes, so that its decorators
    # compile lazily (memtrain/lazy_setup.py, layer 0, imports no torch at module level): no
    # private name is touched; the patch is undone when the module is loaded.
    "memtrain/lazy_setup.py: patches torch.compile": 2,
    # A copy of transformers' GemmaRMSNorm.forward, never called: lean_norm compares its bytecode
    # with the model's to recognise the norm, so it must read ``self._norm`` as transformers does.
    "memtrain/patches/lean_norm.py: self._norm": 1,
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@cache
def _parsed(include_compat: bool = False) -> dict[str, ast.Module]:
    return _read_sources(include_compat)


def _sources(include_compat: bool = False) -> dict[str, ast.Module]:
    return dict(_parsed(include_compat))


def _read_sources(include_compat: bool) -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if include_compat or not rel.startswith("memtrain/_compat/"):
            out[rel] = ast.parse(path.read_text(encoding="utf-8"))
    return out


def _library_imports(tree: ast.Module) -> set[str]:
    """Local names bound (anywhere in the file) to a library module or to a name from one."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in LIBRARIES:
                    names.add(a.asname or a.name.split(".")[0])
        elif (isinstance(node, ast.ImportFrom) and not node.level and node.module
              and node.module.split(".")[0] in LIBRARIES):
            names.update(a.asname or a.name for a in node.names)
    return names


def _own_names(trees: dict[str, ast.Module]) -> set[str]:
    """Private names memtrain defines itself: functions, classes, module and class attributes,
    anything assigned as ``x._name = ...``, keyword names of pydantic private attributes."""
    own = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
    return {n for n in own if _is_private(n)}


@cache
def library_private() -> frozenset[str]:
    """Private attributes of the library objects memtrain works with (their classes and a few
    instances), and private instance attributes those libraries set in ``__init__``."""
    import accelerate
    import peft.tuners.lora as lora
    import torch
    import torchao.optim
    import transformers
    import trl
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mod_tracker import ModTracker

    objects = [torch.zeros(1), torch.nn.Linear(1, 1), torch.nn.Parameter(torch.zeros(1)),
               torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), MemTracker(), ModTracker(),
               FSDPMemTracker, transformers.Trainer, transformers.TrainingArguments,
               transformers.PreTrainedModel, transformers.PretrainedConfig, trl.DPOTrainer, trl.SFTTrainer,
               lora.LoraLayer, lora.Linear, accelerate.Accelerator, accelerate.PartialState,
               torchao.optim.CPUOffloadOptimizer]
    names = {n for obj in objects for n in dir(obj) if _is_private(n)}
    # set in the libraries' __init__ methods, so not on the classes
    names |= {"_metrics", "_total_train_tokens", "_train_batch_size", "_tp_size", "_mod_tracker", "_ac_mod",
              "_in_ac", "_active_module_cnt", "_post_bw_callbacks_to_enqueue", "_has_callback",
              "_name_or_path", "_fsdp_param_group", "_unsharded_param", "_no_split_modules",
              "_loss_shifts_labels", "_overloadpacket", "_type"}
    return frozenset(names)


def _receiver_root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _attribute_findings(tree: ast.Module, lib: set[str], allowed: set[str]) -> list[tuple[int, str]]:
    found = []

    def check(receiver: ast.expr, name: str, line: int, store: bool) -> None:
        root = _receiver_root(receiver)
        from_library = isinstance(root, ast.Name) and root.id in lib
        if store and from_library:
            found.append((line, f"patches {ast.unparse(receiver)}.{name}"))
        elif _is_private(name) and (from_library or not (name in allowed or name.startswith("_memtrain"))):
            found.append((line, f"{ast.unparse(receiver)}.{name}"))

    modules_bound = _module_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            root = _receiver_root(node.value)
            if isinstance(root, ast.Name) and root.id in modules_bound and root.id not in lib:
                continue  # memtrain's or the standard library's modules (``os._exit``, ``meter._ACTIVE``)
            check(node.value, node.attr, node.lineno, isinstance(node.ctx, ast.Store))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ATTR_FUNCTIONS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            check(node.args[0], node.args[1].value, node.lineno, node.func.id in ("setattr", "delattr"))
    return found


def _module_names(tree: ast.Module) -> set[str]:
    """Local names bound by any import statement (modules and names from them)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return names


def _import_findings(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] in LIBRARIES and any(map(_is_private, parts)):
                    found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            parts = node.module.split(".")
            if parts[0] in LIBRARIES:
                if any(map(_is_private, parts)):
                    found.append((node.lineno, f"from {node.module} import"))
                found += [(node.lineno, f"from {node.module} import {a.name}")
                          for a in node.names if _is_private(a.name)]
    return found


def _override_findings(rel: str, tree: ast.Module) -> list[tuple[int, str]]:
    """Rule (c): private methods of a library base class defined again (imports the module)."""
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.bases]
    candidates = {c.name: c for c in classes
                  if any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(s.name)
                         for s in c.body)}
    if not candidates:
        return []
    module = importlib.import_module(rel.removesuffix(".py").removesuffix("/__init__").replace("/", "."))
    found = []
    for name, node in candidates.items():
        cls = getattr(module, name, None)
        if not inspect.isclass(cls):
            continue  # a class inside a function: its bases are checked where it is defined
        library_bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in LIBRARIES]
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(stmt.name):
                owner = next((b for b in library_bases if hasattr(b, stmt.name)), None)
                if owner is not None:
                    where = f"{owner.__module__}.{owner.__qualname__}"
                    found.append((stmt.lineno, f"overrides {where}.{stmt.name}"))
    return found


def private_uses(trees: dict[str, ast.Module] | None = None, only: str | None = None) -> list[str]:
    """Every private use outside memtrain/_compat (in module ``only``, if given), as 'path:line:
    what' lines."""
    trees = _sources() if trees is None else trees
    allowed = _own_names(trees) - library_private()
    out = []
    for rel, tree in trees.items():
        if only is not None and rel != only:
            continue
        found = _import_findings(tree) + _attribute_findings(tree, _library_imports(tree), allowed)
        found += _override_findings(rel, tree)
        out += [f"{rel}:{line}: {what}" for line, what in sorted(set(found))]
    return out


def _key(finding: str) -> str:
    path, _, what = finding.split(":", 2)
    return f"{path}: {what.strip()}"


def test_no_private_library_access_outside_compat() -> None:
    counts = Counter(_key(f) for f in private_uses())
    new = [f for f in private_uses() if counts[_key(f)] > ALLOWED.get(_key(f), 0)]
    assert not new, ("private attributes of torch / transformers / trl / peft / accelerate / torchao are "
                     "touched only in memtrain/_compat (a shim with its versions): " + "\n".join(new))
    gone = sorted(k for k in ALLOWED if counts[k] < ALLOWED[k])
    assert not gone, f"moved into memtrain/_compat: take these out of ALLOWED: {gone}"


def _planted(path: str, code: str) -> list[str]:
    """The findings with ``code`` appended to memtrain's module ``path`` (in memory only)."""
    trees = _sources()
    source = (PACKAGE.parent / path).read_text(encoding="utf-8") + "\n" + code
    trees[path] = ast.parse(source)
    before = set(private_uses(only=path))
    return [f for f in private_uses(trees, only=path) if f not in before]


def test_the_check_sees_each_kind_of_private_use() -> None:
    """Planted, one at a time, in modules outside memtrain/_compat: each is found."""
    cases = {
        "torch._C._cuda_clearCublasWorkspaces()": "torch._C._cuda_clearCublasWorkspaces",
        "from torch.distributed._tools.mod_tracker import ModTracker": "from torch.distributed._tools",
        "from torch.utils.checkpoint import _checkpoint_hook": "import _checkpoint_hook",
        "import torch._dynamo": "import torch._dynamo",
        "def f(trainer):\n    return trainer._prepare_inputs({})": "trainer._prepare_inputs",
        "def f(model):\n    return getattr(model, '_no_split_modules', None)": "model._no_split_modules",
        "def f(p):\n    return p._post_accumulate_grad_hooks": "p._post_accumulate_grad_hooks",
        "from transformers import PreTrainedModel\nPreTrainedModel.initialize_weights = None": "patches",
    }
    for code, expected in cases.items():
        found = _planted("memtrain/estimator/calibrate.py", code)
        assert any(expected in f for f in found), (code, found)
    # memtrain's own private names, and the standard library's, are not library internals
    own = "def f(x):\n    x._memtrain_seen = True\n    os._exit(0)"
    assert not _planted("memtrain/estimator/calibrate.py", own)


def test_the_check_sees_an_override_of_a_private_hook(tmp_path: Path, monkeypatch: Any) -> None:
    """Rule (c): a memtrain class defining a private method its library base has."""
    module = tmp_path / "planted_override.py"
    module.write_text("from transformers import Trainer\n\n\nclass T(Trainer):\n"
                      "    def _save_checkpoint(self, model, trial):\n        pass\n\n"
                      "    def _memtrain_own(self):\n        pass\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = _override_findings("planted_override.py", ast.parse(module.read_text(encoding="utf-8")))
    assert [what for _, what in found] == ["overrides transformers.trainer.Trainer._save_checkpoint"]


def test_compat_imports_no_memtrain_package_but_errors() -> None:
    """memtrain/_compat is a leaf (layer 0): importable by every package, it imports none of them."""
    for rel, tree in _sources(include_compat=True).items():
        if not rel.startswith("memtrain/_compat/"):
            continue
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad = [n for n in names if n.split(".")[0] == "memtrain"
                   and not (n == "memtrain.errors" or n.startswith("memtrain._compat"))]
            assert not bad, f"{rel} imports {bad}: _compat may import only memtrain.errors and itself"
