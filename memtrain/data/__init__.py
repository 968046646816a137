"""Data in: load a dataset, render each format, tokenize, pack, mix, collate.

Modules, in the order a dataset goes through them:

- :mod:`~memtrain.data.prepare` — the entry point: :func:`~memtrain.data.prepare.prepare_data`
  loads the recipe's data (local files, hub ids, ``builtin:`` sets), checks it, tokenizes it per
  format, splits off evaluation and picks the collator;
- :mod:`~memtrain.data.formats` — what one row of each causal format means (alpaca, ShareGPT,
  messages, completion, tokenized, text), before any tokenizer;
- :mod:`~memtrain.data.chat` — rendering rows to text with a chat template and deriving the labels
  from that text;
- :mod:`~memtrain.data.encoders` — one tokenizing encoder per ``data.format``;
- :mod:`~memtrain.data.preference` — preference pairs (prompt, chosen, rejected) as TRL's DPO
  collator takes them, answers located by the same rule as every other format;
- :mod:`~memtrain.data.packing` — several examples per row without cross-talk;
- :mod:`~memtrain.data.mixing` — several datasets by weight (``data.mix``).
- :mod:`~memtrain.data.check` — ``memtrain validate --data``: the data prepared as a run would, described.

Imports only the shared leaves and :mod:`memtrain.config` (docs/architecture.md), and TRL's
preference collator for ``data.format: preference``.
"""
