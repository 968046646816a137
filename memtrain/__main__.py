"""``python -m memtrain`` is the ``memtrain`` command."""

from memtrain.cli.app import main

main()
