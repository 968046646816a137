"""The ``memtrain`` command: thin; each subcommand parses arguments and calls a library function.

- :mod:`~memtrain.cli.app` — the app, ``train``/``validate``/``recipes``/``datasets``, and
  :func:`~memtrain.cli.app.main` (exit statuses: 0 done, 1 a bug, 2 a user mistake, 130 Ctrl-C);
- :mod:`~memtrain.cli.estimate` — ``estimate``, ``plan``, ``calibrate``, and the checks of their options;
- :mod:`~memtrain.cli.runs` — ``report``, ``merge``, ``generate``, ``predict``;
- :mod:`~memtrain.cli.common` — consoles, argument types, user errors (exit status 2).
"""

from memtrain.cli.app import main  # the console script (also as `memtrain.cli:main`)

__all__ = ["main"]
