"""The GPU session's kit (scripts/gpu_kit.py) and script (scripts/gpu_session.sh), checked on a CPU."""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import zipfile
from pathlib import Path

from scripts import gpu_kit

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheels_are_pinned_to_the_versions_tested_here() -> None:
    pins = dict(p.split("==") for p in gpu_kit.pins())
    assert set(pins) == set(gpu_kit.WHEELS)
    assert pins["transformers"] == md.version("transformers") and pins["peft"] == md.version("peft")


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


def test_unsloths_wheels_are_pinned_to_versions_it_accepts() -> None:
    """Unsloth 2026.10.9 accepts transformers <= 5.17.0, trl <= 1.15.0 and datasets < 5 (its METADATA):
    its site gets those (and huggingface_hub 1.x, which 5.17 needs), memtrain's keeps its own; never
    xformers."""
    pins = dict(p.split("==") for p in gpu_kit.UNSLOTH_WHEELS)
    assert {"unsloth", "unsloth_zoo", "transformers", "trl", "datasets"} <= set(pins)
    assert pins["unsloth"] == pins["unsloth_zoo"]
    version = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert version(pins["transformers"]) <= (5, 17, 0) and version(pins["trl"]) <= (1, 15, 0)
    assert version(pins["datasets"]) < (5,)
    assert not {n.replace("_", "-") for n in pins} & {n.replace("_", "-") for n in gpu_kit.NEVER}


def test_a_trimmed_wheel_keeps_its_package_and_a_record_of_only_what_is_there(tmp_path: Path) -> None:
    wheel = tmp_path / "unsloth-1.0-py3-none-any.whl"
    members = {"unsloth/__init__.py": b"x = 1\n", "studio/frontend/app.js": b"0" * 50_000,
               "unsloth-1.0.dist-info/METADATA": b"Name: unsloth\n"}
    record = b"".join(f"{n},sha256=abc,{len(d)}\n".encode() for n, d in members.items())
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        archive.writestr("unsloth-1.0.dist-info/RECORD", record + b"unsloth-1.0.dist-info/RECORD,,\n")
    assert gpu_kit.trimmed(wheel) > 0
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        kept_record = archive.read("unsloth-1.0.dist-info/RECORD").decode()
    assert "studio/frontend/app.js" not in names and "unsloth/__init__.py" in names
    assert "studio/" not in kept_record and "unsloth/__init__.py,sha256=abc,6" in kept_record


def test_the_unsloth_session_runs_the_comparison_with_plans_made_beforehand() -> None:
    script = (ROOT / "scripts" / "gpu_session.sh").read_text(encoding="utf-8")
    assert 'bash scripts/gpu_session.sh unsloth' in script and "scripts/bench/gpu/unsloth.py" in script
    assert "--plans docs/bench/unsloth_plans.json" in script and ".gpusite/unsloth/*.whl" in script
    assert "BENCH_UNSLOTH_SITE=/tmp/site-unsloth" in script


def test_what_the_kit_installs_accepts_what_the_image_has() -> None:
    """Every requirement of a kit wheel on a package the device's image provides (not the kit)
    accepts the image's version: the H200 session of 2026-12-04 stopped at its smoke check because
    transformers 5.25 needs huggingface_hub >= 2.4 and the kit left the image's 1.33 in place, then
    at its first from_pretrained, since 5.25 needs `kernels`, which the image lacks."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    kit = {n.replace("_", "-").lower() for n in gpu_kit.WHEELS} | {"bitsandbytes"}
    refused = []
    for name in sorted(kit):
        for line in md.requires(name) or []:
            req = Requirement(line)
            key = req.name.replace("_", "-").lower()
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if key in kit or key not in gpu_kit.IMAGE:
                continue
            has = gpu_kit.IMAGE[key]
            if has is None or Version(has) not in req.specifier:
                refused.append(f"{name}: {line} (image {has or 'has none'})")
    assert not refused, refused
