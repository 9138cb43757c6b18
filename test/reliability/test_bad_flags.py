"""Bad-flag catalogue: every `--sparse-mode`/`--psa-*` flag with an invalid value, through
SGLang 0.5.17's own argument parsing (`prepare_server_args`, as `launch_server` runs it),
fails as argparse does: exit status 2 and one error line naming the flag (not SGLang's
whole usage), nothing started; so does a flag given without the flag it acts with.
The catalogue must cover every `PSAConfig` field, so a new knob cannot skip it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from sglang_psa.config import PSAConfig, flag_name
from sglang_psa.plugin import flags

pytest.importorskip(
    "sglang.srt.server_args",
    reason="SGLang is not installed (README's first command installs it)",
)

pytestmark = pytest.mark.sglang  # SGLang's own modules: CI runs these on every release

# field -> invalid CLI values (type errors argparse catches, and values PSAConfig refuses)
INVALID = {
    "sparse_mode": ["dense", ""],
    "threshold": ["0", "1.5", "nan", "x"],
    "stop_rule": ["exact"],
    "score": ["random"],
    "block_size": ["24", "0", "-32"],
    "sink_blocks": ["-1", "x"],
    "recent_blocks": ["0"],
    "wave_blocks": ["0", "1.5"],
    "wave_growth": ["0.5", "nan"],
    "max_wave_blocks": ["8"],  # below the first wave (16)
    "wave_fraction": ["1.5", "-0.1", "x"],
    "max_first_wave_blocks": ["0", "2.5"],
    "later_wave_blocks": ["-1", "2.5"],
    "max_read_fraction": ["0", "1.5", "nan", "x"],
    "topk_tokens": ["16", "0"],
    "bound_bits": ["4", "x"],
    "code_bits": ["0", "9", "x"],
    "rerank_interval": ["0", "1.5", "x"],
    "gpu_cache_gb": ["-1"],
    "host_pool_gb": ["0", "-4"],
    "kv_home": ["disk", "HBM", "host"],  # host: the removed home
    "writeback": ["dma", "UVA"],
    "writeback_start": ["0", "1.5", "-0.2", "nan", "x"],
    "cold_fraction": ["-0.1", "1.5", "nan", "x"],
    "unit_cache_ways": ["0", "65", "2.5", "x"],
    "host_prefix_min_tokens": ["-1", "2.5", "x"],
    "ws_window": ["0", "x"],
    "max_inject_tokens": ["0", "2.5"],
    "audit_coverage": ["maybe", "2"],
}

SCRIPT = """
import contextlib, io, json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
out = []
for argv in json.loads(sys.argv[1]):
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf):
            prepare_server_args(["--model-path", "dummy", *argv])
        out.append("accepted")
    except SystemExit as e:
        out.append(f"exit {e.code}: {buf.getvalue()}")
    except Exception as e:
        out.append(f"{type(e).__name__}: {e}")
print(json.dumps(out))
"""


def _cases():
    for name, values in INVALID.items():
        for v in values:
            mode, home = "psa", []
            if name in flags.ONLY_WITH:  # its value is what is wrong, not its partner
                other, value = flags.ONLY_WITH[name]
                mode = value if other == "sparse_mode" else mode
                home = [flag_name(other), value] if other != "sparse_mode" else []
            argv = ["--sparse-mode", mode, *home, flag_name(name), v]
            if name == "sparse_mode":
                argv = ["--sparse-mode", v]
            yield name, argv, ""
    # A flag that acts only with another flag's value, given (with a valid value) without it.
    valid = {"writeback": "engine", "host_pool_gb": "8", "cold_fraction": "0.5", "code_bits": "4",
             "unit_cache_ways": "16", "writeback_start": "0.5"}  # fmt: skip
    for name, (other, value) in flags.ONLY_WITH.items():
        mode = "topk" if other == "kv_home" else "psa"
        argv = ["--sparse-mode", mode, flag_name(name), valid.get(name, "1024")]
        yield name, argv, f"acts only with {flag_name(other)} {value}"
    # A host tier larger than any host's memory: pinned memory is never swapped out.
    argv = ["--sparse-mode", "psa", "--psa-kv-home", "tiered", flag_name("host_pool_gb"),
            "1000000"]  # fmt: skip
    yield "host_pool_gb", argv, "GiB available: give at most"
    # The coverage audit reads keys from SGLang's pool: not at the tiered home.
    argv = ["--sparse-mode", "psa", "--psa-kv-home", "tiered", flag_name("audit_coverage"), "1"]
    yield "audit_coverage", argv, "--psa-kv-home hbm only"
    # A kept selection where no rule could use it: the certified rule, and ε = 1.
    for extra in (["--psa-stop-rule", "certified"], ["--psa-threshold", "1"]):
        argv = ["--sparse-mode", "psa", *extra, flag_name("rerank_interval"), "8"]
        yield "rerank_interval", argv, "keeps a selection for topk and for psa's heuristic"


def _one_error_line(got: str, name: str, says: str) -> bool:
    """`exit 2: ` and exactly one stderr line, argparse's `prog: error: <flag> ...`."""
    if not got.startswith("exit 2: ") or "Traceback" in got:
        return False
    lines = got.split(": ", 1)[1].strip().splitlines()
    return len(lines) == 1 and ": error: " + flag_name(name) in lines[0] and says in lines[0]


def test_the_catalogue_covers_every_knob():
    knobs = {f.name for f in dataclasses.fields(PSAConfig)} - {"extra"}
    assert set(INVALID) == knobs


def test_every_invalid_flag_value_fails_at_startup_naming_the_flag():
    cases = list(_cases())
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), json.dumps([a for _, a, _ in cases])],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    bad = [
        (argv, got[-300:])
        for (name, argv, says), got in zip(cases, results)
        if not _one_error_line(got, name, says)
    ]
    assert not bad, "\n".join(map(str, bad))
    assert len(cases) >= 30
