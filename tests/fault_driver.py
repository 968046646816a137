"""Run the ``memtrain`` command with a fault injected: ``python tests/fault_driver.py TARGET AFTER
EXCEPTION ARGS...`` replaces ``TARGET`` (``module:attr.path``) by a function that calls the original
``AFTER`` times and then raises ``EXCEPTION`` (``RuntimeError`` or ``KeyboardInterrupt``), then
runs :func:`memtrain.cli.app.main` as the console script does. Used by tests/cli/test_exit_codes.py."""

from __future__ import annotations

import builtins
import importlib
import sys
from typing import Any


def inject(target: str, after: int, exception: type[BaseException]) -> None:
    module_name, _, attr = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    calls = [0]

    def faulty(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > after:
            raise exception(f"injected fault in {target} (call {calls[0]})")
        return original(*args, **kwargs)

    setattr(owner, name, faulty)


if __name__ == "__main__":
    target, after, exception, *argv = sys.argv[1:]
    inject(target, int(after), getattr(builtins, exception))
    sys.argv = ["memtrain", *argv]
    from memtrain.cli.app import main

    main()
