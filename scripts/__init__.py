"""memtrain's benchmarks, the probes they measure with, and the maintainers' tools.

    python -m scripts                    # list the benchmarks, by what they measure
    python -m scripts run NAME [ARGS]    # run one; it writes docs/bench/NAME.md
    python -m scripts run NAME --quick   # its CI-sized run (writes nothing)

- ``probes/``: the measured side, sharing no code with memtrain (``memprobe``, the FSDP probe, the
  model builders of the technique benchmarks); tests import them.
- ``bench/<group>/``: one module per benchmark, grouped by what it measures (``accuracy``: the
  estimate against a measured step; ``techniques``: what a technique saves and costs; ``planner``:
  the planner's choices, speed and long context; ``recipes``: the offline recipes as a user runs
  them; ``gpu``: the CUDA-only ones). Each starts its page with :func:`scripts.harness.header`.
- ``tools/``: generated docs, the version table and a plan's log (``plan_log``: each candidate the
  technique search traced, with its wall time and bound); ``gpu_kit.py``, ``gpu_session.sh``,
  ``setup.sh`` and ``version_leg.sh`` are the shell-level tools.
"""
