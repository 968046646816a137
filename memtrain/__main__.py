"""``python -m memtrain`` is the ``memtrain`` command."""

from memtrain.cli.main import main

main()
