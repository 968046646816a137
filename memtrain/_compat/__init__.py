"""The only place memtrain touches private attributes of torch, transformers, trl, peft,
accelerate and torchao (issue 35; docs/architecture.md, layer 0; ``tests/test_compat.py`` fails on
one used anywhere else).

Each shim says what it touches, why no public API does it (or which public API would, once
upstream has one), and the versions it was checked on. A private name that is gone raises
:class:`memtrain._compat.versions.CompatError` naming the shim, the installed version and the
tested range, not a deep ``AttributeError``.

- ``versions``: the tested range of each dependency, :func:`~versions.check_versions` (warns once),
  :func:`~versions.private` (a private attribute, or a clear error);
- ``torch_trackers``: ``torch.distributed._tools``' MemTracker / FSDPMemTracker / ModTracker, their
  private hooks and state behind public names;
- ``torch_tools``: fake mode, the dispatch-mode stack, tensor internals (hooks dicts, views,
  versions), ``torch._C``'s cuBLAS workspaces, the CUDA allocator's settings, private ops;
- ``torch_distributed``: FSDP2's private state, the fake process group's store, DTensor's sharding
  propagation;
- ``transformers_trainer``: the Trainer's private methods and state, process-wide patches of
  transformers under a fake mode;
- ``trl``, ``peft``, ``torchao``, ``accelerate``: one shim each.
"""
