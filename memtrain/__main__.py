"""``python -m memtrain`` is the ``memtrain`` command."""

from memtrain.cli import main

main()
