"""Does keeping a block selection across decode steps change the answers? (CPU, real model)

    python benchmark/studies/kept_selection_study.py --context-tokens 8192 --per-kind 1
    python benchmark/studies/kept_selection_study.py --context-tokens 16384 --name kept_selection_cpu_16k

The server ranks blocks every `--psa-rerank-interval` (8) decode steps and reads the kept
order between, psa at the ranked read count its rule took then (`keep_selection` in the
transformers hook models it; every suite before measured a fresh ranking each step). On the
same generated tasks, greedy 64-token answers of dense, psa at the defaults ranking every
step, psa keeping its selection 8 steps, and top-k (2048 tokens) both ways: accuracy,
identical-to-dense answers and KV fraction per policy. Writes
benchmark/results/archive/<name>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from sglang_psa.config import PSAConfig
from sglang_psa.eval.results import write_result
from sglang_psa.eval.runner import evaluate, policy_summary
from sglang_psa.eval.tasks import GENERATORS, make_tasks
from sglang_psa.hf.attention import DecodePolicy
from sglang_psa.hf.decode import load_model
from sglang_psa.models import DEFAULT_MODEL, MODELS, ensure_model

RESULTS = Path(__file__).resolve().parents[1] / "results" / "archive"
NEW_TOKENS = 64


def policies(interval: int) -> dict[str, DecodePolicy]:
    psa, topk = PSAConfig(rerank_interval=interval), PSAConfig(sparse_mode="topk")
    topk = topk.replace(rerank_interval=interval)
    return {
        "dense": DecodePolicy("dense"),
        "psa fresh": DecodePolicy("psa", psa),
        "psa kept": DecodePolicy("psa", psa, keep_selection=True),
        "topk fresh": DecodePolicy("topk", topk),
        "topk kept": DecodePolicy("topk", topk, keep_selection=True),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--context-tokens", type=int, default=8192)
    ap.add_argument("--per-kind", type=int, default=1)
    ap.add_argument("--kinds", default=",".join(GENERATORS))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--interval", type=int, default=PSAConfig().rerank_interval)
    ap.add_argument("--name", default="kept_selection_cpu_8k")
    args = ap.parse_args()
    pols = policies(args.interval)
    model, tok = load_model(ensure_model(args.model))
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    kinds = args.kinds.split(",")
    tasks = make_tasks(kinds, args.context_tokens, args.per_kind, args.seed, count)
    tasks = [dataclasses.replace(t, max_new_tokens=NEW_TOKENS) for t in tasks]
    print(f"[kept selection] {len(tasks)} tasks x {len(pols)} policies", flush=True)
    outs = evaluate(model, tok, tasks, list(pols.values()), progress=True)
    names = list(pols)
    table = {}
    for i, name in enumerate(names):
        rows = outs[i :: len(names)]
        table[name] = {
            **policy_summary(rows),
            "identical": sum(o.agrees_with_dense for o in rows),
            "tasks": [
                {
                    "task": o.task,
                    "correct": o.correct,
                    "identical": o.agrees_with_dense,
                    "kv_fraction": o.kv_fraction,
                }
                for o in rows
            ],  # fmt: skip
        }
        print(name, {k: v for k, v in table[name].items() if k != "tasks"}, flush=True)
    key = {"psa fresh": "psa_fresh", "psa kept": "psa_kept", "topk fresh": "topk_fresh",
           "topk kept": "topk_kept"}  # fmt: skip
    summary = {
        "n_tasks": len(tasks),
        "accuracy_dense": table["dense"]["accuracy"],
        **{f"identical_{key[n]}": table[n]["identical"] / len(tasks) for n in key},
        **{f"accuracy_{key[n]}": table[n]["accuracy"] for n in key},
        **{f"kv_fraction_{key[n]}": table[n]["kv_fraction"] for n in key},
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
        interval=args.interval,
        new_tokens=NEW_TOKENS,
    )
    print(summary)


if __name__ == "__main__":
    main()
