"""The offline bundle's split / manifest / verify / assemble logic on small synthetic files.

No network: scripts/offline_bundle.py is imported from its path; the shell
scripts run on a tiny bundle (one handmade wheel, a fake kernel folder and two
fake model GGUFs in handmade wheels).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import lzma
import os
import random
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_psa.models import MODELS

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
KNOWN = "known: " + ", ".join(MODELS) + ", none"  # every model the bundle can carry


def _load():
    spec = importlib.util.spec_from_file_location("offline_bundle", SCRIPTS / "offline_bundle.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("offline_bundle", mod)
    spec.loader.exec_module(mod)
    return mod


ob = _load()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sha_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def synthetic_tar(tmp_path: Path) -> Path:
    """A small tar of random files (about 10 KiB)."""
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(0)
    for i in range(5):
        (src / f"f{i}.bin").write_bytes(rng.randbytes(1500 + 300 * i))
    tar_path = tmp_path / "bundle.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(src, arcname="psa-bundle")
    return tar_path


def _split(tar_path: Path, out: Path, part_bytes: int) -> dict:
    parts = ob.split_file(tar_path, out, part_bytes)
    ob.write_manifest(out, parts, tar_path.stat().st_size, _sha(tar_path))
    return ob.load_manifest(out)


def test_split_sizes_and_reassembly(synthetic_tar: Path, tmp_path: Path):
    out = tmp_path / "parts"
    m = _split(synthetic_tar, out, 1000)
    size = synthetic_tar.stat().st_size
    assert m["part_count"] == len(m["parts"]) == -(-size // 1000)
    assert [p["name"] for p in m["parts"]] == [
        f"psa-bundle.part-{i:03d}" for i in range(m["part_count"])
    ]
    assert all(p["size"] <= 1000 for p in m["parts"])
    assert sum(p["size"] for p in m["parts"]) == size
    for p in m["parts"]:
        assert _sha(out / p["name"]) == p["sha256"]
    assert ob.verify_stage(out)["total_sha256"] == _sha(synthetic_tar)
    joined = ob.assemble(out, tmp_path / "joined.tar")
    assert _sha(joined) == _sha(synthetic_tar)
    with tarfile.open(joined) as tar:
        assert len(tar.getnames()) == 6


def test_split_exact_multiple_and_stale_parts(tmp_path: Path):
    src = tmp_path / "blob"
    src.write_bytes(b"x" * 3000)
    out = tmp_path / "parts"
    assert len(ob.split_file(src, out, 100)) == 30
    parts = ob.split_file(src, out, 1000)  # a resplit removes the 27 stale parts
    assert [p["size"] for p in parts] == [1000, 1000, 1000]
    assert sorted(p.name for p in out.iterdir()) == [p["name"] for p in parts]


def test_resplit_cuts_a_built_bundle_again_keeping_its_description(
    synthetic_tar: Path, tmp_path: Path
):
    """`resplit` re-cuts OUT/bundle.tar (no rebuild): new parts, the same bundle, the
    manifest's description of its content kept; a tar that is not the manifest's bundle
    is refused."""
    out = tmp_path / "bundle"
    out.mkdir()
    tar = out / "bundle.tar"
    tar.write_bytes(synthetic_tar.read_bytes())
    parts = ob.split_file(tar, out / "parts", 1000)
    ob.write_manifest(out / "parts", parts, tar.stat().st_size, _sha(tar),
                      sglang="0.5.17", models=["qwen2.5-0.5b"], part_mib=1000 / ob.MIB)  # fmt: skip
    assert ob.main(["resplit", str(out), "--part-mib", str(400 / ob.MIB)]) == 0
    m = ob.load_manifest(out / "parts")
    assert m["part_count"] == -(-tar.stat().st_size // 400) > len(parts)
    assert (m["sglang"], m["models"], m["part_mib"]) == ("0.5.17", ["qwen2.5-0.5b"], 400 / ob.MIB)
    assert ob.verify_stage(out / "parts")["total_sha256"] == _sha(tar)
    assert _sha(ob.assemble(out / "parts", tmp_path / "joined.tar")) == _sha(tar)
    tar.write_bytes(tar.read_bytes() + b"x")
    assert ob.main(["resplit", str(out)]) == 1


def test_a_default_part_fits_a_device_call_beside_the_tracked_tree():
    """A device call carries `CARRY_MIB` with the working tree: the tracked files, a
    default part and its manifest leave at least 2 MiB (a folder of wheels, the files a
    session adds before it commits). Fails as the results grow: lower the default and
    `resplit` the built bundles."""
    import subprocess

    if not (ob.REPO / ".git").exists():
        pytest.skip("counts a git checkout's tracked files")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ob.REPO, capture_output=True,
                           check=True).stdout.split(b"\0")  # fmt: skip
    tree = sum((ob.REPO / f.decode()).stat().st_size for f in files if f)
    assert tree + (ob.DEFAULT_PART_MIB + 2) * ob.MIB + 64 * 1024 <= ob.CARRY_MIB * ob.MIB, (
        f"tracked files {tree / ob.MIB:.1f} MiB + a {ob.DEFAULT_PART_MIB} MiB part"
    )


def test_corrupt_part_is_named(synthetic_tar: Path, tmp_path: Path):
    out = tmp_path / "parts"
    m = _split(synthetic_tar, out, 1000)
    bad = m["parts"][3]["name"]
    data = bytearray((out / bad).read_bytes())
    data[10] ^= 0xFF  # same size, other content
    (out / bad).write_bytes(bytes(data))
    with pytest.raises(ob.BundleError, match=f"part {bad} is corrupt"):
        ob.verify_stage(out)
    with pytest.raises(ob.BundleError, match=f"part {bad} is corrupt"):
        ob.verify_part(out, m, bad)
    ob.verify_part(out, m, m["parts"][0]["name"])  # the others still pass
    st = ob.stage_status(out)
    assert st["bad"] == [bad] and not st["missing"] and len(st["ok"]) == st["total"] - 1
    # by size only (what staging prints after checking the one part it staged): the same
    # size passes, the sha256 is install_offline.sh's to check
    assert ob.stage_status(out, deep=False)["ok"] == [p["name"] for p in m["parts"]]
    with pytest.raises(ob.BundleError, match=bad):
        ob.assemble(out, tmp_path / "joined.tar")

    (out / bad).write_bytes(bytes(data[:-1]))  # truncated
    with pytest.raises(ob.BundleError, match=f"part {bad} is corrupt"):
        ob.verify_part(out, m, bad)
    assert ob.stage_status(out, deep=False)["bad"] == [bad]


def test_missing_part_and_manifest(synthetic_tar: Path, tmp_path: Path):
    out = tmp_path / "parts"
    m = _split(synthetic_tar, out, 1000)
    gone = m["parts"][-1]["name"]
    (out / gone).unlink()
    with pytest.raises(ob.BundleError, match=f"part {gone} is missing"):
        ob.verify_stage(out)
    assert ob.stage_status(out)["missing"] == ob.stage_status(out, deep=False)["missing"] == [gone]
    (out / ob.MANIFEST_NAME).unlink()
    with pytest.raises(ob.BundleError, match="MANIFEST.json is missing"):
        ob.verify_stage(out)


def _handmade_wheel(
    dest: Path, name: str = "psa_toy", version: str = "1.0", extra: dict | None = None
) -> Path:
    """A minimal pure wheel: one module (plus `extra` {arcname: bytes}) and its dist-info."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": b"VALUE = 42\n",
        **(extra or {}),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for arc, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{arc},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for arc, data in files.items():
            zf.writestr(arc, data)
    return path


def _model_wheel(dest: Path, name: str, payload: bytes) -> Path:
    path = dest / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/toy.gguf", payload)
    return path


def _payload(key: str, size: int) -> bytes:
    return random.Random(key).randbytes(size)


def _toy_bundle(
    tmp_path: Path,
    part_bytes: int = 4096,
    keys: tuple[str, ...] = ("toy", "toy2"),
    old_style: bool = False,
) -> tuple[Path, dict]:
    """build/offline/parts-like folder of a tiny bundle made by write_tar + split_file.

    Model i's GGUF (900 + 100*i bytes) is split over i + 1 wheels. `old_style`
    writes BUNDLE.json as bundles did before --model took a list (one "model" dict).
    """
    src = tmp_path / "src"
    (src / "kernel" / "sgl_kernel").mkdir(parents=True)
    (src / "kernel" / "sgl_kernel" / "__init__.py").write_text("SLIM = True\n")
    fa3 = _payload("fa3", 3000)  # FA3's library travels xz-compressed
    (src / "kernel" / "sgl_kernel" / "flash_ops.abi3.so.xz").write_bytes(lzma.compress(fa3))
    kernel_xz = [
        {"path": "sgl_kernel/flash_ops.abi3.so", "size": len(fa3), "sha256": _sha_bytes(fa3)}
    ]
    # like nvidia-cutlass-dsl: a .pth whose import line puts a folder of the wheel on sys.path
    pth = b"import sys, os, psa_toy; sys.path.insert(0, os.path.join(os.path.dirname(psa_toy.__file__), 'psa_toy_dsl'))\n"
    wheel = _handmade_wheel(
        src, extra={"psa_toy_dsl/psa_hidden.py": b"HIDDEN = 7\n", "psa_toy_dsl.pth": pth}
    )
    items = [
        ob.Item(wheel, f"wheels/{wheel.name}", "wheel", "psa_toy", "1.0"),
        ob.Item(src / "kernel" / "sgl_kernel", "kernel/sgl_kernel", "kernel", "k", "0"),
    ]
    models = []
    for i, key in enumerate(keys):
        payload = _payload(key, 900 + 100 * i)
        cut = len(payload) // (i + 1)
        chunks = [payload[j * cut : (j + 1) * cut if j < i else None] for j in range(i + 1)]
        names = [f"toy_model{i}_part{j}" for j in range(i + 1)]
        mwheels = [_model_wheel(src, n, c) for n, c in zip(names, chunks)]
        items += [ob.Item(w, f"models/{w.name}", "model", n, "0.1") for w, n in zip(mwheels, names)]
        models.append(
            {
                "key": key,
                "wheels": [w.name for w in mwheels],
                "members": [f"{n}/toy.gguf" for n in names],
                "sha256": hashlib.sha256(payload).hexdigest(),
            }
        )
    if old_style:
        assert len(models) <= 1
        info = {"format": 1, "model": models[0] if models else None}
    else:
        info = {"format": 1, "models": models, "kernel_xz": kernel_xz}
    tar_path = tmp_path / "bundle.tar"
    ob.write_tar(items, info, tar_path)
    parts_dir = tmp_path / "parts"
    return parts_dir, _split(tar_path, parts_dir, part_bytes)


def _unpack(parts_dir: Path, tmp_path: Path) -> Path:
    """Join and untar the parts as install_offline.sh does; returns psa-bundle/."""
    joined = ob.assemble(parts_dir, tmp_path / "joined.tar")
    with tarfile.open(joined) as tar:
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path / "x", **kw)
    return tmp_path / "x" / ob.BUNDLE_ROOT


def _run(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, **(env_extra or {})}
    return subprocess.run(["bash", *args], capture_output=True, text=True, env=env)


needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_write_tar_is_reproducible(tmp_path: Path):
    wheel = _handmade_wheel(tmp_path)
    items = [ob.Item(wheel, f"wheels/{wheel.name}", "wheel", "psa_toy", "1.0")]
    ob.write_tar(items, {"format": 1}, tmp_path / "b1.tar")
    os.utime(wheel, (1, 1))  # only the file's time changes
    ob.write_tar(items, {"format": 1}, tmp_path / "b2.tar")
    assert _sha(tmp_path / "b1.tar") == _sha(tmp_path / "b2.tar")
    with tarfile.open(tmp_path / "b1.tar") as tar:
        assert tar.getnames() == ["psa-bundle/BUNDLE.json", f"psa-bundle/wheels/{wheel.name}"]


def test_parse_models_comma_list():
    assert ob.parse_models("none") == []
    assert ob.parse_models("smollm2-135m") == ["smollm2-135m"]
    assert ob.parse_models("smollm2-135m, qwen2.5-0.5b,smollm2-135m,") == [
        "smollm2-135m",
        "qwen2.5-0.5b",
    ]
    assert ob.parse_models(["qwen2.5-0.5b", "smollm2-135m"]) == ["qwen2.5-0.5b", "smollm2-135m"]
    with pytest.raises(ob.BundleError, match=r"--model: unknown model\(s\) 'bogus'") as e:
        ob.parse_models("smollm2-135m,bogus")
    assert KNOWN in str(e.value)
    for bad in ("", "none,smollm2-135m"):
        with pytest.raises(ob.BundleError, match="--model"):
            ob.parse_models(bad)


def test_unknown_model_fails_before_download(tmp_path: Path, monkeypatch, capsys):
    def no_network(*a, **k):
        raise AssertionError("must not download or build")

    monkeypatch.setattr(ob, "download", no_network)
    monkeypatch.setattr(ob, "build_project_wheels", no_network)
    with pytest.raises(ob.BundleError, match="--model: unknown model"):
        ob.build(tmp_path, model="smollm2-135m,bogus")
    with pytest.raises(SystemExit) as e:
        ob.main(["--out", str(tmp_path), "--model", "smollm2-135m,bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--model" in err and "'bogus'" in err
    assert KNOWN in err
    assert not any(tmp_path.iterdir())


def test_main_builds_with_the_default_model_none(tmp_path: Path, monkeypatch):
    """`--model none` (the default) reaches build as no model, not as a usage error."""
    seen = []

    def fake_build(out, part_mib, model, *rest):
        seen.append(ob.parse_models(model))
        return {"total_size": 0, "total_sha256": "", "part_count": 0}

    monkeypatch.setattr(ob, "build", fake_build)
    assert ob.main(["--out", str(tmp_path)]) == 0
    assert ob.main(["--out", str(tmp_path), "--model", "smollm2-135m"]) == 0
    assert seen == [[], ["smollm2-135m"]]


def test_build_with_two_fake_models_then_place(tmp_path: Path, monkeypatch):
    """build() with every package excluded and two fake models cached in OUT/wheels."""
    out = tmp_path / "out"
    cache_wheels = out / "wheels"
    cache_wheels.mkdir(parents=True)
    specs, payloads = {}, {}
    for key, n in (("toy-a", 1), ("toy-b", 3)):
        payloads[key] = payload = _payload(key, 1200)
        cut = len(payload) // n
        packages, members = [], []
        for j in range(n):
            pkg = f"{key.replace('-', '_')}_part{j}"
            chunk = payload[j * cut : (j + 1) * cut if j < n - 1 else None]
            _handmade_wheel(cache_wheels, pkg, "0.1", extra={f"{pkg}/data.bin": chunk})
            packages.append(f"{pkg}==0.1")
            members.append(f"{pkg}/data.bin")
        specs[key] = SimpleNamespace(
            name=f"{key} (fake)",
            packages=tuple(packages),
            members=tuple(members),
            sha256=hashlib.sha256(payload).hexdigest(),
        )
    monkeypatch.setattr(ob, "_models", lambda: specs)

    def no_network(*a, **k):
        raise AssertionError("no subprocess (pip) in this test")

    monkeypatch.setattr(ob.subprocess, "run", no_network)
    everything = [ob._split_req(r)[0] for r in (*ob.PACKAGES, ob.KERNEL_PACKAGE)]
    manifest = ob.build(
        out,
        part_mib=0.005,
        model="toy-b,toy-a,toy-b",
        skip_download=True,
        exclude=(*everything, *ob.PROJECT_NAMES),
    )
    assert manifest["models"] == ["toy-b", "toy-a"]
    assert sorted(p["kind"] for p in manifest["packages"]) == ["model"] * 4
    assert manifest["part_count"] > 1

    bundle = _unpack(out / "parts", tmp_path)
    info = json.loads((bundle / ob.BUNDLE_INFO).read_text())
    assert "model" not in info
    assert [m["key"] for m in info["models"]] == ["toy-b", "toy-a"]
    assert info["models"][0]["wheels"] == [f"toy_b_part{j}-0.1-py3-none-any.whl" for j in range(3)]
    cache = tmp_path / "cache"
    paths = ob.place_model(bundle, cache)
    assert paths == [cache / "gguf" / "toy-b.gguf", cache / "gguf" / "toy-a.gguf"]
    for key, path in zip(("toy-b", "toy-a"), paths):
        assert path.read_bytes() == payloads[key]
    assert len(list((cache / "wheels").glob("*.whl"))) == 4


# --- --sglang: one package list per SGLang release (RELEASES) ---


def _pins(reqs) -> dict[str, str]:
    pins = dict(ob._split_req(r) for r in reqs)
    assert all(pins.values()), "every bundled package is pinned"
    assert len(pins) == len(reqs), "no package twice"
    return pins


def test_releases_pin_sglang_torch_and_the_kernel():
    assert ob.DEFAULT_SGLANG == "0.5.17" and list(ob.RELEASES) == ["0.5.17", "0.5.23"]
    assert ob.RELEASES["0.5.17"] == (ob.PACKAGES, ob.KERNEL_PACKAGE)
    old = _pins(ob.PACKAGES)
    assert old["sglang"] == "0.5.17" and "torch" not in old  # the host's torch 2.11.0 serves
    assert ob.KERNEL_PACKAGE == "sglang-kernel==0.4.5"

    packages, kernel = ob.RELEASES["0.5.23"]
    assert packages is ob.PACKAGES_0_5_23 and kernel == "sglang-kernel==0.4.10"
    new = _pins(packages)
    # SGLang 0.5.23's own pins (its Requires-Dist) ...
    for name, version in {
        "sglang": "0.5.23",
        "flashinfer-python": "0.7.2",
        "xgrammar": "0.2.7",
        "compressed-tensors": "0.18.0",
        "transformers": "5.19.0",
        "tokenizers": "0.23.2",
        "openai": "2.8.0",
        "apache-tvm-ffi": "0.1.11",
        "soundfile": "0.13.1",
    }.items():
        assert new.pop(name) == version, name
    # ... torch 2.14.1 and what it pins differently from the host's torch 2.11.0+cu130 ...
    for name, version in {
        "torch": "2.14.1",
        "triton": "3.8.0",
        "torchvision": "0.29.1",  # SGLang's engine imports it; the host's fails on 2.14.1
        # Qwen2/Llama import SGLang's CuTe DSL dual GEMM on CUDA (cu13 flavor only)
        "nvidia-cutlass-dsl": "4.8.0",
        "nvidia-cutlass-dsl-libs-base": "4.8.0",
        "nvidia-cutlass-dsl-libs-core": "4.8.0",
        "nvidia-cutlass-dsl-libs-cu13": "4.8.0",
        "cuda-toolkit": "13.0.3.0",
        "nvidia-cublas": "13.1.1.3",
        "nvidia-cudnn-cu13": "9.24.0.43",
        "nvidia-cusparselt-cu13": "0.8.1",
        "nvidia-nccl-cu13": "2.30.7",
    }.items():
        assert new.pop(name) == version, name
    # ... and the rest of the 0.5.17 list as it is.
    assert new == {k: v for k, v in old.items() if k in new}
    assert set(old) - set(new) == {
        "sglang",
        "flashinfer-python",
        "xgrammar",
        "compressed-tensors",
        "transformers",
        "tokenizers",
        "openai",
        "apache-tvm-ffi",
        "soundfile",
    }


def test_nccl_wheel_tag_is_a_target_platform():
    # nvidia-nccl-cu13 2.30.7 ships only manylinux_2_18; pip matches --platform exactly
    assert "manylinux_2_18_x86_64" in ob.PLATFORMS and "manylinux_2_34_x86_64" in ob.PLATFORMS
    wheel = "nvidia_nccl_cu13-2.30.7-py3-none-manylinux_2_18_x86_64.whl"
    from packaging.utils import parse_wheel_filename

    assert set(parse_wheel_filename(wheel)[3]) & ob._target_tags()


def test_build_sglang_0_5_23_uses_its_list(tmp_path: Path, monkeypatch, capsys):
    """build(sglang="0.5.23") bundles that release's wheels (stand-ins cached in OUT/wheels)."""
    out = tmp_path / "out"
    (out / "wheels").mkdir(parents=True)
    keep = {"sglang": "0.5.23", "torch": "2.14.1"}
    for name, version in keep.items():
        _handmade_wheel(out / "wheels", name, version)
    monkeypatch.setattr(ob.subprocess, "run", lambda *a, **k: pytest.fail("no pip here"))
    others = [ob._split_req(r)[0] for r in (*ob.PACKAGES_0_5_23, "sglang-kernel")]
    exclude = (*(n for n in others if n not in keep), *ob.PROJECT_NAMES)
    manifest = ob.build(out, model="none", skip_download=True, exclude=exclude, sglang="0.5.23")
    assert manifest["sglang"] == "0.5.23"
    assert {p["name"]: p["version"] for p in manifest["packages"]} == keep
    info = json.loads((_unpack(out / "parts", tmp_path) / ob.BUNDLE_INFO).read_text())
    assert info["sglang"] == "0.5.23"
    # the default list has neither torch nor sglang 0.5.23: nothing cached serves it
    with pytest.raises(ob.BundleError, match="not cached"):
        ob.build(out, model="none", skip_download=True)
    with pytest.raises(ob.BundleError, match="--sglang '0.6.0'"):
        ob.build(out, sglang="0.6.0")
    with pytest.raises(SystemExit):
        ob.main(["--out", str(out), "--sglang", "0.6.0"])
    assert "invalid choice: '0.6.0'" in capsys.readouterr().err


def test_place_model(tmp_path: Path, capsys):
    parts_dir, _ = _toy_bundle(tmp_path)
    bundle = _unpack(parts_dir, tmp_path)
    cache = tmp_path / "cache"
    paths = ob.place_model(bundle, cache)
    assert paths == [cache / "gguf" / "toy.gguf", cache / "gguf" / "toy2.gguf"]
    info = json.loads((bundle / ob.BUNDLE_INFO).read_text())
    for path, model in zip(paths, info["models"]):
        assert _sha(path) == model["sha256"]
        assert all((cache / "wheels" / w).is_file() for w in model["wheels"])
    assert paths[1].read_bytes() == _payload("toy2", 1000)  # joined from two wheels

    assert ob.main(["place-model", str(bundle), "--cache", str(cache)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(p) for p in paths]

    info["models"][1]["sha256"] = "0" * 64
    (bundle / ob.BUNDLE_INFO).write_text(json.dumps(info))
    paths[1].unlink()
    with pytest.raises(ob.BundleError, match="toy2: GGUF sha256"):
        ob.place_model(bundle, cache)

    info["models"] = []
    (bundle / ob.BUNDLE_INFO).write_text(json.dumps(info))
    assert ob.place_model(bundle, cache) == []
    assert ob.main(["place-model", str(bundle), "--cache", str(cache)]) == 0
    assert capsys.readouterr().out == "(no model in the bundle)\n"


def test_place_model_reads_old_single_model_bundle(tmp_path: Path):
    parts_dir, _ = _toy_bundle(tmp_path, keys=("toy",), old_style=True)
    bundle = _unpack(parts_dir, tmp_path)
    info = json.loads((bundle / ob.BUNDLE_INFO).read_text())
    assert "models" not in info and info["model"]["key"] == "toy"
    cache = tmp_path / "cache"
    assert ob.place_model(bundle, cache) == [cache / "gguf" / "toy.gguf"]
    assert (cache / "gguf" / "toy.gguf").read_bytes() == _payload("toy", 900)

    info["model"] = None  # an old bundle built with --model none
    (bundle / ob.BUNDLE_INFO).write_text(json.dumps(info))
    assert ob.place_model(bundle, cache) == []


@needs_bash
def test_install_offline_fails_naming_corrupt_part(tmp_path: Path):
    parts_dir, m = _toy_bundle(tmp_path)
    bad = m["parts"][1]["name"]
    with open(parts_dir / bad, "r+b") as f:
        f.seek(5)
        f.write(b"\0\1\2")
    res = _run(str(SCRIPTS / "install_offline.sh"), str(parts_dir), str(tmp_path / "site"))
    assert res.returncode != 0
    assert f"part {bad} is corrupt" in res.stderr
    assert not (tmp_path / "site" / "psa_toy.py").exists()

    (parts_dir / bad).unlink()
    res = _run(str(SCRIPTS / "install_offline.sh"), str(parts_dir), str(tmp_path / "site"))
    assert res.returncode != 0 and f"part {bad} is missing" in res.stderr


@needs_bash
def test_stage_then_install_end_to_end(tmp_path: Path):
    parts_dir, m = _toy_bundle(tmp_path)
    stage, site, cache = tmp_path / "stage", tmp_path / "site", tmp_path / "cache"
    n = m["part_count"]
    for i, p in enumerate(m["parts"]):
        res = _run(str(SCRIPTS / "device_stage.sh"), str(parts_dir / p["name"]), str(stage))
        assert res.returncode == 0, res.stderr
        assert f"staged {i + 1}/{n} parts" in res.stdout
    assert "complete" in res.stdout

    env = {"SGLANG_PSA_CACHE": str(cache)}
    res = _run(str(SCRIPTS / "install_offline.sh"), str(stage), str(site), env_extra=env)
    assert res.returncode == 0, res.stderr
    export = res.stdout.strip().splitlines()[-1]
    assert export.startswith("export PYTHONPATH=") and str(site) in export
    assert (site / "psa_toy.py").read_text() == "VALUE = 42\n"
    assert (site / "psa_toy-1.0.dist-info").is_dir()
    assert (site / "sgl_kernel" / "__init__.py").read_text() == "SLIM = True\n"
    assert (site / "sgl_kernel" / "flash_ops.abi3.so").read_bytes() == _payload("fa3", 3000)
    assert not (site / "sgl_kernel" / "flash_ops.abi3.so.xz").exists()
    assert (cache / "gguf" / "toy.gguf").stat().st_size == 900
    assert (cache / "gguf" / "toy2.gguf").stat().st_size == 1000
    for key in ("toy", "toy2"):
        assert f"model GGUF at {cache / 'gguf' / key}.gguf\n" in res.stderr
    assert (site / "psa-env.sh").read_text().splitlines()[-1] == export
    # the .pth's path follows SITE, so its module imports with that PYTHONPATH alone
    assert f"{site}:{site / 'psa_toy_dsl'}" in export
    pypath = export.removeprefix("export PYTHONPATH=").split("${")[0]
    res = subprocess.run(
        [sys.executable, "-S", "-c", "import psa_hidden; print(psa_hidden.HIDDEN)"],
        env={**os.environ, "PYTHONPATH": pypath},
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0 and res.stdout == "7\n", res.stderr

    res = _run(str(SCRIPTS / "install_offline.sh"), str(stage), str(site), env_extra=env)
    assert res.returncode == 0 and "already installed" in res.stderr
    assert res.stdout.strip().splitlines()[-1] == export


@needs_bash
def test_device_stage_rejects_corrupt_copy(tmp_path: Path):
    parts_dir, m = _toy_bundle(tmp_path)
    name = m["parts"][0]["name"]
    (parts_dir / name).write_bytes(b"garbage")
    stage = tmp_path / "stage"
    res = _run(str(SCRIPTS / "device_stage.sh"), str(parts_dir / name), str(stage))
    assert res.returncode != 0 and name in res.stderr
    assert not (stage / name).exists()


# --- sglang-kernel: FA3 and the sm90 kernels kept, what an H100 never loads dropped ---

# The shared libraries of sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl.
KERNEL_045_LIBS = (
    "sgl_kernel/flash_ops.abi3.so",  # FA3 (sm80, sm86, sm90 cubins), 1.07 GB
    "sgl_kernel/flashmla_ops.abi3.so",
    "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so",
    "sgl_kernel/sm100/common_ops.abi3.so",
    "sgl_kernel/sm90/common_ops.abi3.so",
    "sgl_kernel/spatial_ops.abi3.so",
)


def test_kernel_keeps_fa3_and_sm90_and_drops_what_an_h100_never_loads():
    kept = [m for m in KERNEL_045_LIBS if not ob.kernel_dropped(m)]
    assert kept == [
        "sgl_kernel/flash_ops.abi3.so",
        "sgl_kernel/flashmla_ops.abi3.so",
        "sgl_kernel/sm90/common_ops.abi3.so",
        "sgl_kernel/spatial_ops.abi3.so",
    ]
    # sm100/: load_utils loads it at every compute capability but 9.0; infllm: CPython 3.10
    assert ob.kernel_dropped("sgl_kernel/sm100/anything.py")
    assert not ob.kernel_dropped("sgl_kernel/flash_attn.py")
    assert ob.KERNEL_XZ == ("sgl_kernel/flash_ops.abi3.so",)


def _kernel_wheel(dest: Path) -> tuple[Path, dict[str, bytes]]:
    """A small sglang-kernel-like wheel with the real wheel's library names; RECORD lists
    every file."""
    rng = random.Random("kernel")
    files = {m: rng.randbytes(2000) * 20 for m in KERNEL_045_LIBS}  # compressible, like cubins
    files["sgl_kernel/__init__.py"] = b"KERNEL = 1\n"
    files["sgl_kernel/flash_attn.py"] = b"from sgl_kernel import flash_ops\n"
    files["triton_kernels/__init__.py"] = b""
    dist = "sglang_kernel-0.4.5.dist-info"
    files[f"{dist}/METADATA"] = b"Metadata-Version: 2.1\nName: sglang-kernel\nVersion: 0.4.5\n"
    record = [f"{m},sha256=x,{len(d)}" for m, d in files.items()] + [f"{dist}/RECORD,,"]
    path = dest / "sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for arc, data in files.items():
            info = zipfile.ZipInfo(arc)
            info.external_attr = (0o755 if arc.endswith(".so") else 0o644) << 16
            zf.writestr(info, data)
        zf.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return path, files


def test_slim_kernel_ships_fa3_compressed_and_the_host_restores_it(tmp_path: Path):
    wheel, files = _kernel_wheel(tmp_path)
    out = tmp_path / "kernel"
    tops, name, version = ob.slim_kernel(wheel, out)
    assert [t.name for t in tops] == [
        "sgl_kernel",
        "sglang_kernel-0.4.5.dist-info",
        "triton_kernels",
    ]
    assert (name, version) == ("sglang-kernel", "0.4.5")
    shipped = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert shipped == sorted(
        [
            ".kernel_xz.json",
            ".source",
            "sgl_kernel/__init__.py",
            "sgl_kernel/flash_attn.py",
            "sgl_kernel/flash_ops.abi3.so.xz",
            "sgl_kernel/flashmla_ops.abi3.so",
            "sgl_kernel/sm90/common_ops.abi3.so",
            "sgl_kernel/spatial_ops.abi3.so",
            "sglang_kernel-0.4.5.dist-info/METADATA",
            "sglang_kernel-0.4.5.dist-info/RECORD",
            "triton_kernels/__init__.py",
        ]
    )
    fa3 = files["sgl_kernel/flash_ops.abi3.so"]
    xz = out / "sgl_kernel" / "flash_ops.abi3.so.xz"
    assert lzma.decompress(xz.read_bytes()) == fa3 and xz.stat().st_size < len(fa3) // 4
    assert (out / "sgl_kernel/sm90/common_ops.abi3.so").read_bytes() == files[
        "sgl_kernel/sm90/common_ops.abi3.so"
    ]
    info = ob.kernel_xz_info(out)
    assert info == [
        {
            "path": "sgl_kernel/flash_ops.abi3.so",
            "size": len(fa3),
            "sha256": _sha_bytes(fa3),
            "mode": 0o755,
        }
    ]
    record = (out / "sglang_kernel-0.4.5.dist-info/RECORD").read_text().splitlines()
    listed = {ln.split(",", 1)[0] for ln in record}
    assert "sgl_kernel/flash_ops.abi3.so" in listed  # as installed once restored
    assert not any("sm100" in m or "infllm" in m for m in listed)
    # cached: a second call with the same wheel and recipe does not unpack again
    xz.write_bytes(xz.read_bytes())
    mtime = xz.stat().st_mtime_ns
    ob.slim_kernel(wheel, out)
    assert xz.stat().st_mtime_ns == mtime

    # through the bundle: tar, parts, unpack, restore on the host
    items = [ob.Item(t, f"kernel/{t.name}", "kernel", name, version) for t in tops]
    ob.write_tar(items, {"format": 1, "kernel_xz": info}, tmp_path / "bundle.tar")
    bundle = _unpack(_toy_split(tmp_path), tmp_path)
    restored = bundle / "kernel" / "sgl_kernel" / "flash_ops.abi3.so"
    assert ob.main(["unxz-kernel", str(bundle)]) == 0
    assert restored.read_bytes() == fa3 and os.access(restored, os.X_OK)
    assert not restored.with_name("flash_ops.abi3.so.xz").exists()
    assert ob.unxz_kernel(bundle) == [restored]  # restored already: left as it is

    # a corrupt archive, or one restoring other bytes, is named
    restored.unlink()
    restored.with_name("flash_ops.abi3.so.xz").write_bytes(lzma.compress(fa3[:-1]))
    with pytest.raises(ob.BundleError, match="flash_ops.abi3.so: restored"):
        ob.unxz_kernel(bundle)
    restored.with_name("flash_ops.abi3.so.xz").write_bytes(b"not xz")
    with pytest.raises(ob.BundleError, match="flash_ops.abi3.so.xz is corrupt"):
        ob.unxz_kernel(bundle)
    assert not restored.exists()


def _toy_split(tmp_path: Path) -> Path:
    tar_path = tmp_path / "bundle.tar"
    parts_dir = tmp_path / "parts"
    _split(tar_path, parts_dir, 1 << 20)
    return parts_dir
