"""The GPU session's kit (scripts/gpu_kit.py) and script (scripts/gpu_session.sh), checked on a CPU."""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
from pathlib import Path

from scripts import gpu_kit

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheels_are_pinned_to_the_versions_tested_here() -> None:
    pins = dict(p.split("==") for p in gpu_kit.pins())
    assert set(pins) == set(gpu_kit.WHEELS)
    assert pins["transformers"] == md.version("transformers") and pins["peft"] == md.version("peft")
    assert "huggingface-hub" not in pins and "huggingface_hub" not in pins  # 2.4 needs httpx2


def test_only_the_devices_cuda_library_is_unpacked() -> None:
    names = ["bitsandbytes/__init__.py", "bitsandbytes/nn/modules.py", "bitsandbytes/libbitsandbytes_cpu.so",
             "bitsandbytes/libbitsandbytes_cuda128.so", "bitsandbytes/libbitsandbytes_cuda130.so",
             "bitsandbytes/libbitsandbytes_rocm70.so", "bitsandbytes-0.50.2.dist-info/METADATA"]
    assert gpu_kit.kept(names, "130") == ["bitsandbytes/__init__.py", "bitsandbytes/nn/modules.py",
                                          "bitsandbytes/libbitsandbytes_cpu.so",
                                          "bitsandbytes/libbitsandbytes_cuda130.so",
                                          "bitsandbytes-0.50.2.dist-info/METADATA"]


def test_the_session_script_names_tests_and_files_that_exist() -> None:
    """A renamed CUDA test would cost a GPU session its test run: every test the script names is
    a function of its file, and the long-context plan it passes is committed."""
    script = (ROOT / "scripts" / "gpu_session.sh").read_text(encoding="utf-8")
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_session.sh")], check=True)
    named = re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", script)
    assert len(named) >= 6
    for path, function in named:
        source = (ROOT / path).read_text(encoding="utf-8")
        assert not function or f"def {function}(" in source, f"{path}::{function}"
    assert "--long-plans docs/bench/gpu_long_plans.json" in script
    assert (ROOT / "docs" / "bench" / "gpu_long_plans.json").exists()
