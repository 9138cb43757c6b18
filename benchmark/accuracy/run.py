"""Long-context accuracy vs KV fraction read: dense, PSA (ε, rule) and top-k (budget, scoring).

    python benchmark/accuracy/run.py --context-tokens 8192 --per-kind 2

Writes benchmark/results/accuracy_<device>.json (summary keys of issue 3) and a
plot of accuracy against the fraction of KV blocks read.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

import torch

from sglang_psa.config import PSAConfig
from sglang_psa.eval.results import write_result
from sglang_psa.eval.runner import evaluate, policy_summary
from sglang_psa.eval.tasks import GENERATORS, make_tasks
from sglang_psa.hf.attention import DecodePolicy
from sglang_psa.hf.decode import load_model
from sglang_psa.models import DEFAULT_MODEL, MODELS, ensure_model

RESULTS = Path(__file__).resolve().parents[1] / "results" / "archive"


def policies(context: int, topk_fracs: list[float]) -> list[DecodePolicy]:
    base = PSAConfig()
    out = [DecodePolicy("dense", base)]
    for rule in ("heuristic", "certified"):
        for eps in (0.95, 0.98):
            out.append(DecodePolicy("psa", base.replace(threshold=eps, stop_rule=rule)))
    for score in ("mean", "bound"):
        for f in topk_fracs:
            budget = max(2 * base.block_size, int(f * context) // base.block_size * base.block_size)
            out.append(DecodePolicy("topk", base.replace(score=score, topk_tokens=budget), budget))
    return out


def aggregate(outcomes, pols) -> dict[str, dict]:
    by = defaultdict(list)
    for o in outcomes:
        by[o.policy].append(o)
    table = {}
    for p in pols:
        rows = by[p.label]
        per_kind = defaultdict(list)
        for o in rows:
            per_kind[o.task].append(o.correct)
        table[p.label] = {
            "kind": p.kind,
            "threshold": p.cfg.threshold if p.kind == "psa" else None,
            "stop_rule": p.cfg.stop_rule if p.kind == "psa" else None,
            "score": p.cfg.score,
            "budget_tokens": p.budget_tokens,
            **policy_summary(rows),
            "accuracy_per_task": {k: sum(v) / len(v) for k, v in per_kind.items()},
        }
    return table


def topk_equal_accuracy(table: dict, target: float, score: str) -> float | None:
    """Smallest measured KV fraction at which top-k (`score`) reaches `target` accuracy."""
    pts = sorted(
        (r["kv_fraction"], r["accuracy"])
        for r in table.values()
        if r["kind"] == "topk" and r["score"] == score
    )
    for frac, acc in pts:
        if acc >= target - 1e-9:
            return frac
    return None


def plot(table: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for score, style in (("mean", "o-"), ("bound", "s--")):
        pts = sorted(
            (r["kv_fraction"], r["accuracy"])
            for r in table.values()
            if r["kind"] == "topk" and r["score"] == score
        )
        if pts:
            ax.plot(*zip(*pts), style, label=f"top-k ({score} score)", alpha=0.8)
    for name, r in table.items():
        if r["kind"] == "psa":
            marker = "*" if r["stop_rule"] == "heuristic" else "P"
            ax.plot(r["kv_fraction"], r["accuracy"], marker, markersize=13, label=name)
        elif r["kind"] == "dense":
            ax.plot(1.0, r["accuracy"], "kD", label="dense")
    ax.set_xscale("log")
    ax.set_xlabel("fraction of KV blocks read (log)")
    ax.set_ylabel("exact-match accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--context-tokens", type=int, default=8192)
    ap.add_argument("--per-kind", type=int, default=2, help="tasks per task kind")
    ap.add_argument("--kinds", default=",".join(GENERATORS))
    ap.add_argument("--topk-fracs", default="0.03,0.06,0.12,0.25,0.5")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--name", default=None, help="result name (default accuracy_<device>)")
    ap.add_argument(
        "--kl",
        action="store_true",
        help="also the mean next-token KL from dense along dense's tokens (teacher forced; "
        "one more decode pass per policy)",
    )
    args = ap.parse_args()

    model, tok = load_model(ensure_model(args.model), device=args.device)
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])
    tasks = make_tasks(args.kinds.split(","), args.context_tokens, args.per_kind, args.seed, count)
    pols = policies(args.context_tokens, [float(x) for x in args.topk_fracs.split(",")])
    outcomes = evaluate(model, tok, tasks, pols, kl=args.kl)
    table = aggregate(outcomes, pols)
    ctx = round(sum(o.context_tokens for o in outcomes) / len(outcomes))
    psa98 = table["psa-heuristic-0.98"]["accuracy"]
    eq = [
        v
        for v in (topk_equal_accuracy(table, psa98, s) for s in ("mean", "bound"))
        if v is not None
    ]
    summary = {
        "context_tokens": ctx,
        "accuracy_dense": table["dense"]["accuracy"],
        "accuracy_psa_095": table["psa-heuristic-0.95"]["accuracy"],
        "accuracy_psa_098": psa98,
        "kv_fraction_psa_095": table["psa-heuristic-0.95"]["kv_fraction"],
        "kv_fraction_psa_098": table["psa-heuristic-0.98"]["kv_fraction"],
        "kv_fraction_topk_equal_accuracy": min(eq) if eq else None,
        "accuracy_psa_certified_095": table["psa-certified-0.95"]["accuracy"],
        "accuracy_psa_certified_098": table["psa-certified-0.98"]["accuracy"],
        "kv_fraction_psa_certified_095": table["psa-certified-0.95"]["kv_fraction"],
        "kv_fraction_psa_certified_098": table["psa-certified-0.98"]["kv_fraction"],
        "n_tasks": len(tasks),
    }
    if summary["kv_fraction_topk_equal_accuracy"]:
        summary["topk_over_psa_098_kv_ratio"] = (
            summary["kv_fraction_topk_equal_accuracy"] / summary["kv_fraction_psa_098"]
        )
    name = args.name or f"accuracy_{'cpu' if args.device == 'cpu' else 'gpu'}"
    out = write_result(
        RESULTS / f"{name}.json",
        summary,
        {"policies": table, "runs": [o.to_json() for o in outcomes]},
        model=MODELS[args.model].name,
        per_kind=args.per_kind,
        seed=args.seed,
    )
    plot(
        table,
        RESULTS / f"{name}.png",
        f"{args.model}, {ctx} tokens, {len(tasks)} tasks ({args.device})",
    )
    print(f"\n{'policy':28s} {'acc':>6s} {'agree':>6s} {'kv_frac':>8s}")
    for name_, r in table.items():
        print(
            f"{name_:28s} {r['accuracy']:6.3f} {r['agreement_with_dense']:6.3f} "
            f"{r['kv_fraction']:8.4f}"
        )
    print(
        "summary:",
        {
            k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v)
            for k, v in summary.items()
        },
    )
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
