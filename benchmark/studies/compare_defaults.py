"""Dense vs PSA's default vs a candidate default, on the same generated tasks.

    python benchmark/studies/compare_defaults.py --context-tokens 8192 --per-kind 1
    python benchmark/studies/compare_defaults.py --context-tokens 16384 --kinds doc_qa \
        --name defaults_cpu_16k
    python benchmark/studies/compare_defaults.py --model smollm2-135m --context-tokens 4096 \
        --per-kind 3 --kinds niah_1key,niah_4key,variable_tracking,doc_qa --seed 1 \
        --extra "wave 32:wave_blocks=32" --name defaults_cpu_smollm_4k

The candidate is Quest's bound for ranking with a 16-block first wave
(`--psa-score bound --psa-wave-blocks 16`), the flag-level stand-in for the
stop-rule study's fix (bound ranking plus a floor of the 16 best blocks).
Writes benchmark/results/<name>.json with accuracy, agreement with dense and
KV fraction per policy, and per task.
"""

from __future__ import annotations

import argparse
import re

from study import parser, run, save

from sglang_psa.config import PSAConfig, flag_name
from sglang_psa.hf.attention import DecodePolicy
from sglang_psa.plugin.flags import add_psa_args, config_from_namespace

POLICIES = {
    "dense": DecodePolicy("dense"),
    # Spelled out: PSAConfig's defaults became the candidate's after this comparison.
    "default (mean, wave 8)": DecodePolicy(
        "psa", PSAConfig(threshold=0.98, score="mean", wave_blocks=8)
    ),
    "candidate (bound, wave 16)": DecodePolicy(
        "psa", PSAConfig(threshold=0.98, score="bound", wave_blocks=16)
    ),
}


def extra_policy(spec: str) -> tuple[str, DecodePolicy]:
    """`NAME:field=value,...` -> PSA at the current defaults (ε 0.98) with those fields,
    parsed and checked as the server's `--psa-<field>` flags are."""
    name, _, fields = spec.partition(":")
    flags = argparse.ArgumentParser(prog=f"--extra {name!r}")
    add_psa_args(flags)
    argv = ["--sparse-mode", "psa", "--psa-threshold", "0.98"]
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        argv += [flag_name(key), value]
    return name, DecodePolicy("psa", config_from_namespace(flags.parse_args(argv)))


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0], "defaults_cpu_8k")
    ap.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="NAME:FIELD=VALUE,...",
        help="another policy: the current defaults with these PSAConfig fields changed "
        "(e.g. 'wave 32:wave_blocks=32'); repeatable",
    )
    args = ap.parse_args()
    policies = dict(POLICIES)
    policies.update(extra_policy(spec) for spec in args.extra)
    tasks, table = run(args, policies)
    names = list(policies)
    summary = {
        "n_tasks": len(tasks),
        "accuracy_dense": table["dense"]["accuracy"],
        "accuracy_default": table[names[1]]["accuracy"],
        "accuracy_candidate": table[names[2]]["accuracy"],
        "kv_fraction_default": table[names[1]]["kv_fraction"],
        "kv_fraction_candidate": table[names[2]]["kv_fraction"],
        **{
            f"{key}_{re.sub(r'[^a-z0-9]+', '_', name.lower())}": table[name][field]
            for name in names[3:]
            for key, field in (("accuracy", "accuracy"), ("kv_fraction", "kv_fraction"))
        },
    }
    save(args, summary, table)


if __name__ == "__main__":
    main()
