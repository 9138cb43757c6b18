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
from pathlib import Path

from sglang_psa.config import PSAConfig, flag_name
from sglang_psa.eval.results import write_result
from sglang_psa.eval.runner import evaluate, policy_summary
from sglang_psa.eval.tasks import GENERATORS, make_tasks
from sglang_psa.hf.attention import DecodePolicy
from sglang_psa.hf.decode import load_model
from sglang_psa.models import DEFAULT_MODEL, MODELS, ensure_model
from sglang_psa.plugin.flags import add_psa_args, config_from_namespace

RESULTS = Path(__file__).resolve().parents[1] / "results" / "archive"
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
    parser = argparse.ArgumentParser(prog=f"--extra {name!r}")
    add_psa_args(parser)
    argv = ["--sparse-mode", "psa", "--psa-threshold", "0.98"]
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        argv += [flag_name(key), value]
    return name, DecodePolicy("psa", config_from_namespace(parser.parse_args(argv)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--context-tokens", type=int, default=8192)
    ap.add_argument("--per-kind", type=int, default=1)
    ap.add_argument("--kinds", default=",".join(GENERATORS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="defaults_cpu_8k")
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
    model, tok = load_model(ensure_model(args.model))
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    kinds = args.kinds.split(",")
    tasks = make_tasks(kinds, args.context_tokens, args.per_kind, args.seed, count)
    print(f"[defaults] {len(tasks)} tasks x {len(policies)} policies", flush=True)
    outs = evaluate(model, tok, tasks, list(policies.values()), progress=True)
    names = list(policies)
    table = {}
    for i, name in enumerate(names):
        rows = outs[i :: len(names)]
        table[name] = {
            **policy_summary(rows),
            "tasks": [
                {"task": o.task, "correct": o.correct, "kv_fraction": o.kv_fraction} for o in rows
            ],
        }
        print(name, {k: v for k, v in table[name].items() if k != "tasks"}, flush=True)
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
    write_result(
        RESULTS / f"{args.name}.json",
        summary,
        {"policies": table},
        model=MODELS[args.model].name,
        context_tokens=args.context_tokens,
        kinds=kinds,
        per_kind=args.per_kind,
        seed=args.seed,
    )
    print(summary)


if __name__ == "__main__":
    main()
