"""Every reference to a test or a script names a file that exists (issue 36: 38 had gone stale
when the tests moved into tests/<package>/).

A reference is a path under ``tests/`` or ``scripts/`` ending in ``.py`` or ``.sh``, optionally with
``::name`` (a test, class or other top-level name, which must then be defined in that file), in the
docs, the README and CONTRIBUTING, docstrings and comments of memtrain/, scripts/ and tests/.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a path starting at tests/ or scripts/ (not the tail of a longer path), and an optional ::name
REFERENCE = re.compile(r"(?<![\w/.-])((?:tests|scripts)/[\w/.-]*?\.(?:py|sh))(?![\w/])(?:::(\w+))?")
SEARCHED = {"README.md": "", "CONTRIBUTING.md": "", "docs": ".md", "memtrain": ".py", "scripts": "",
            "tests": "", ".ci": ""}
TEXT = (".py", ".md", ".sh", ".txt", ".toml", ".yaml", ".yml", "")
SKIPPED = {"__pycache__", ".venv", ".git", ".gpusite", "assets"}


def searched_files(root: Path) -> list[Path]:
    """The files searched for references (this one's examples below are not references)."""
    out = []
    for name, suffix in SEARCHED.items():
        top = root / name
        if top.is_file():
            out.append(top)
        elif top.is_dir():
            out += [p for p in sorted(top.rglob("*")) if p.is_file()
                    and not SKIPPED & set(p.relative_to(root).parts) and p != Path(__file__).resolve()
                    and (p.suffix == suffix if suffix else p.suffix in TEXT)]
    return out


def broken_references(root: Path) -> list[str]:
    """``file:line: reference`` for each reference to a missing file, or to a name its file lacks."""
    broken = []
    defined: dict[Path, str] = {}
    for path in searched_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for match in REFERENCE.finditer(line):
                target, name = root / match.group(1), match.group(2)
                where = f"{path.relative_to(root)}:{number}: {match.group(0)}"
                if not target.is_file():
                    broken.append(f"{where} (no such file)")
                    continue
                if name is None:
                    continue
                if target not in defined:
                    defined[target] = target.read_text(encoding="utf-8")
                if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^{name}\s*[:=]",
                                 defined[target], re.MULTILINE):
                    broken.append(f"{where} (no `{name}` in that file)")
    return broken


def test_every_reference_to_a_test_or_a_script_exists() -> None:
    broken = broken_references(ROOT)
    assert not broken, "references to files or names that do not exist (fix the path or remove it):\n" + \
        "\n".join(broken)


def test_every_relative_link_of_the_docs_exists() -> None:
    """Markdown links to files of the repository (``[text](../memtrain/plan/costmodel.py)``)."""
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = [f"{page.relative_to(ROOT)}:{number}: {target}"
              for page in pages
              for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
              for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", line)
              if "://" not in target and not target.startswith("mailto:")
              and not (page.parent / target).exists()]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_a_reference_to_a_missing_file_or_name_is_found(tmp_path: Path) -> None:
    (tmp_path / "tests" / "data").mkdir(parents=True)
    (tmp_path / "tests" / "data" / "test_real.py").write_text("def test_there():\n    pass\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "bench_x.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "Checked by `tests/data/test_real.py::test_there` and scripts/bench_x.py.\n"
        "Moved: `tests/test_real.py`; gone: tests/data/test_real.py::test_gone; scripts/bench_y.sh.\n"
        "Not references: memtrain/tests/x.py, `tests/<package>/`, scripts/bench_*.py.\n")
    (tmp_path / "memtrain").mkdir()
    (tmp_path / "memtrain" / "mod.py").write_text('"""As tests/data/test_real.py shows."""\n'
                                                  "# see tests/missing/test_nothing.py\n")
    assert broken_references(tmp_path) == [
        "docs/page.md:2: tests/test_real.py (no such file)",
        "docs/page.md:2: tests/data/test_real.py::test_gone (no `test_gone` in that file)",
        "docs/page.md:2: scripts/bench_y.sh (no such file)",
        "memtrain/mod.py:2: tests/missing/test_nothing.py (no such file)",
    ]
