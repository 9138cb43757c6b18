"""Where PSA's KV fraction goes: PSA variants against the true-mass oracle on the real model.

    python benchmark/studies/sparsity_study.py --context-tokens 8192

For a few generated tasks, decode greedily with dense attention, PSA at the
default settings, PSA with one-block waves (no wave rounding), PSA ranked by
Quest's bound, and the oracle (blocks by their true mass: the fewest any
ranking could read for the same ε). Reports the mean fraction of KV blocks read
and agreement with dense per policy -> benchmark/results/archive/sparsity_cpu.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from sglang_psa.config import PSAConfig
from sglang_psa.eval.results import write_result
from sglang_psa.eval.runner import evaluate, policy_summary
from sglang_psa.eval.tasks import make_tasks
from sglang_psa.hf.attention import DecodePolicy
from sglang_psa.hf.decode import load_model
from sglang_psa.models import DEFAULT_MODEL, MODELS, ensure_model

RESULTS = Path(__file__).resolve().parents[1] / "results" / "archive"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--context-tokens", type=int, default=8192)
    ap.add_argument("--kinds", default="niah_4key,variable_tracking,doc_qa")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    model, tok = load_model(ensure_model(args.model), device=args.device)
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])
    tasks = make_tasks(args.kinds.split(","), args.context_tokens, 1, args.seed, count)
    base = PSAConfig()
    variants = {
        "default": {},
        "one-block waves": {"wave_blocks": 1, "wave_growth": 1.0},
        "bound ranking": {"score": "bound"},
    }
    policies, names = [DecodePolicy("dense", base)], ["dense"]
    for eps in (0.95, 0.98):
        for vname, kw in variants.items():
            policies.append(DecodePolicy("psa", base.replace(threshold=eps, **kw)))
            names.append(f"psa {vname} {eps}")
        policies.append(DecodePolicy("oracle", base.replace(threshold=eps)))
        names.append(f"oracle {eps}")
    outcomes = evaluate(model, tok, tasks, policies)
    table = {}
    for i, name in enumerate(names):
        rows = outcomes[i :: len(policies)]
        table[name] = {
            **policy_summary(rows),
            "layer_mean": [sum(col) / len(col) for col in zip(*(o.layer_mean for o in rows))],
        }
    ctx = round(sum(o.context_tokens for o in outcomes) / len(outcomes))
    summary = {"context_tokens": ctx, "n_tasks": len(tasks)}
    for eps in (0.95, 0.98):
        tag = str(eps).replace("0.", "")
        summary[f"kv_fraction_psa_{tag}"] = table[f"psa default {eps}"]["kv_fraction"]
        summary[f"kv_fraction_psa_one_block_waves_{tag}"] = table[f"psa one-block waves {eps}"][
            "kv_fraction"
        ]
        summary[f"kv_fraction_oracle_{tag}"] = table[f"oracle {eps}"]["kv_fraction"]
    out = write_result(
        RESULTS / "sparsity_cpu.json",
        summary,
        {"policies": table, "runs": [o.to_json() for o in outcomes]},
        model=MODELS[args.model].name,
    )
    for name, r in table.items():
        print(
            f"{name:28s} kv {r['kv_fraction']:.3f}  agree {r['agreement_with_dense']:.2f}  "
            f"acc {r['accuracy']:.2f}"
        )
    print("summary:", summary)
    print("wrote", out)


if __name__ == "__main__":
    main()
