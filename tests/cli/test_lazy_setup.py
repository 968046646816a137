"""The libraries' import-time set-up that the ``memtrain`` command defers (memtrain/lazy_setup.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from memtrain import lazy_setup


def _run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_deferred_compile_is_made_on_the_first_call_with_the_same_options():
    made = []

    def compile(fn, **options):
        made.append(options)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    def double(x):
        return 2 * x

    wrapped = lazy_setup._deferred_compile(compile, double, dynamic=False)
    assert made == [] and wrapped.__name__ == "double"
    assert wrapped(3) == ("compiled", 6) and wrapped(4) == ("compiled", 8)
    assert made == [{"dynamic": False}]  # made once
    decorated = lazy_setup._deferred_compile(compile, mode="max-autotune")(double)  # @torch.compile(...)
    assert made == [{"dynamic": False}] and decorated(1) == ("compiled", 2)
    assert made[-1] == {"mode": "max-autotune"}


def test_a_compile_that_fails_raises_once_then_the_plain_function_runs():
    def compile(fn, **options):
        raise RuntimeError("no compiler here")

    wrapped = lazy_setup._deferred_compile(compile, lambda x: x + 1)
    with pytest.raises(RuntimeError, match="no compiler"):  # bitsandbytes falls back on it
        wrapped(1)
    assert wrapped(1) == 2


def test_the_libraries_are_set_up_when_used_and_still_work():
    found = _run("""
        import json, sys
        from memtrain import lazy_setup
        lazy_setup.install()
        import bitsandbytes, peft, transformers.trainer, memtrain.estimator.estimate, memtrain.trainer.trainer
        out = {"inductor": "torch._inductor.compile_fx" in sys.modules,
               "datasets": type(sys.modules["datasets"]).__name__}
        import torch
        import bitsandbytes.functional as F
        w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
        q, state = F.quantize_4bit(w, quant_type="nf4")
        out["nf4_error"] = float((F.dequantize_4bit(q, state) - w).abs().mean())
        from datasets import Dataset
        from memtrain.data import prepare as data
        out["rows"] = Dataset.from_dict({"text": ["a", "b", "c"]}).num_rows
        out["datasets_after"] = type(sys.modules["datasets"]).__name__
        print(json.dumps(out))
    """)
    # Without lazy_setup both are loaded by these imports (bitsandbytes' torch.compile calls,
    # transformers.trainer's `import datasets`).
    assert found["inductor"] is False
    assert found["datasets"] == "_LazyModule"
    assert found["datasets_after"] == "module" and found["rows"] == 3
    assert 0 < found["nf4_error"] < 0.15  # a 4-bit round trip of N(0, 1) values


def test_the_command_installs_it_before_anything_else():
    found = _run("""
        import json, sys
        import memtrain.cli.app as cli
        cli.app = lambda: print(json.dumps({"finders": [type(f).__name__ for f in sys.meta_path],
                                            "torch": "torch" in sys.modules}))
        cli.main()
    """)
    assert "_Finder" in found["finders"] and found["torch"] is False


def test_imports_in_the_block_make_no_full_collection_and_are_then_frozen():
    code = """
        import gc, json, sys
        from memtrain import lazy_setup
        full = []
        gc.callbacks.append(lambda phase, info: full.append(1) if phase == "start" and info["generation"] == 2
                            else None)
        if sys.argv[1] == "block":
            with lazy_setup.importing():
                import memtrain.estimator.estimate
        else:
            import memtrain.estimator.estimate
        print(json.dumps({"full": len(full), "enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}))
    """
    def run(how: str) -> dict:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), how], capture_output=True,
                              text=True, timeout=300, check=True)
        return json.loads(done.stdout.splitlines()[-1])

    plain, block = run("plain"), run("block")
    assert plain["full"] >= 2 and plain["frozen"] == 0  # what the block spares: full passes over the imports
    assert block["full"] == 0 and block["enabled"] is True
    assert block["frozen"] > 300_000  # torch's, transformers' and peft's objects, out of later passes


def test_the_collector_runs_again_after_the_block_even_when_it_fails():
    import gc

    assert gc.isenabled()
    try:
        with pytest.raises(ImportError), lazy_setup.importing():
            assert not gc.isenabled()
            import memtrain_no_such_module  # noqa: F401
        assert gc.isenabled()
        gc.disable()  # one disabled before the block stays disabled
        with lazy_setup.importing():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_the_heavy_commands_import_their_libraries_in_the_block():
    found = _run("""
        import contextlib, json, sys
        from memtrain import lazy_setup
        import memtrain.cli.app as cli
        real, seen = lazy_setup.importing, []

        @contextlib.contextmanager
        def importing():
            before = "torch" in sys.modules
            with real():
                yield
            seen.append([before, "torch" in sys.modules])

        lazy_setup.importing = importing
        end = cli._end_without_teardown
        cli._end_without_teardown = lambda: (print(json.dumps({"seen": seen})), end())
        sys.argv = ["memtrain", "estimate", "tiny-llama-shakespeare", "--device", "cpu", "--json"]
        cli.main()
    """)
    assert found["seen"] == [[False, True]]  # torch and the rest were first imported inside it


def test_transformers_scans_its_model_folders_once_per_installation_with_the_same_structure(tmp_path) -> None:
    """Plain, transformers scans its ~570 model folders twice per process (its cache keeps 128);
    set up, once, and a later process reads the scan from the store (no folder scanned)."""
    code = """
        import json, sys
        from memtrain import lazy_setup
        if sys.argv[1] == "installed":
            lazy_setup.install()
        import transformers
        from transformers.models.bert import modeling_bert  # imports transformers.models: its second scan
        import transformers.utils.import_utils as iu
        info = iu.create_import_structure_from_path.cache_info()
        models = sys.modules["transformers.models"]
        print(json.dumps({"misses": info.misses, "hits": info.hits, "maxsize": info.maxsize,
                          "stored": getattr(info, "stored", None),
                          "top": sorted(dir(transformers)), "models": sorted(dir(models))}))
    """
    env = {**os.environ, "MEMTRAIN_CACHE_DIR": str(tmp_path)}

    def run(how: str) -> dict:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), how], capture_output=True,
                              text=True, timeout=300, check=True, env=env)
        return json.loads(done.stdout.splitlines()[-1])

    plain, first, later = run("plain"), run("installed"), run("installed")
    assert plain["maxsize"] == 128 and first["maxsize"] is None
    assert first["misses"] > 400 and plain["misses"] > 1.8 * first["misses"]  # each folder once
    assert first["hits"] >= 1 and first["stored"] == 0  # the second scan: the first's, whole
    assert later["misses"] == 0 and later["stored"] == first["misses"]  # every folder from the store
    assert len(list(tmp_path.glob("transformers-imports-*.marshal"))) == 1
    for run_ in (first, later):
        assert run_["top"] == plain["top"] and run_["models"] == plain["models"]
    assert len(plain["top"]) > 1000


def test_scipy_optimizers_are_imported_when_a_detection_loss_first_calls_one() -> None:
    code = """
        import json, sys
        from memtrain import lazy_setup
        if sys.argv[1] == "installed":
            lazy_setup.install()
        import transformers.modeling_utils  # its loss functions, the detection losses among them
        from transformers.loss import loss_for_object_detection as detr, loss_rt_detr as rt
        from transformers.utils import is_scipy_available
        imported = "scipy.optimize" in sys.modules
        matched = detr.linear_sum_assignment([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])
        print(json.dumps({"imported": imported, "after": "scipy.optimize" in sys.modules,
                          "same": detr.linear_sum_assignment is rt.linear_sum_assignment,
                          "available": is_scipy_available(), "cols": [int(c) for c in matched[1]]}))
    """
    def run(how: str) -> dict:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), how], capture_output=True,
                              text=True, timeout=300, check=True)
        return json.loads(done.stdout.splitlines()[-1])

    plain, installed = run("plain"), run("installed")
    assert plain["imported"] and not installed["imported"]  # 0.26 s of every command, not spent
    assert installed["after"] and installed["available"] and installed["same"]
    assert installed["cols"] == plain["cols"] == [1, 0, 2]
