"""Regenerate docs/RECIPES.md from the recipe schema: python scripts/gen_docs.py"""

from pathlib import Path

from memtrain.config.reference import render_reference

if __name__ == "__main__":
    path = Path(__file__).resolve().parent.parent / "docs" / "RECIPES.md"
    path.write_text(render_reference(), encoding="utf-8")
    print(f"wrote {path}")
