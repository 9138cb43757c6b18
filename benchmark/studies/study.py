"""What the policy-comparison studies share: their arguments, one run of every policy on
the same generated tasks (dense first), the per-policy table, and the result file."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from sglang_psa.eval.results import write_result
from sglang_psa.eval.runner import evaluate, policy_summary
from sglang_psa.eval.tasks import GENERATORS, make_tasks
from sglang_psa.hf.attention import DecodePolicy
from sglang_psa.hf.decode import load_model
from sglang_psa.models import DEFAULT_MODEL, MODELS, ensure_model

RESULTS = Path(__file__).resolve().parents[1] / "results" / "archive"


def parser(description: str, name: str, seed: int = 0) -> argparse.ArgumentParser:
    """The model, the tasks (context, per kind, kinds, seed) and the result's name."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--context-tokens", type=int, default=8192)
    ap.add_argument("--per-kind", type=int, default=1)
    ap.add_argument("--kinds", default=",".join(GENERATORS))
    ap.add_argument("--seed", type=int, default=seed)
    ap.add_argument("--name", default=name)
    return ap


def run(args, policies: dict[str, DecodePolicy], new_tokens: int | None = None):
    """Every policy (the first dense) on the tasks `args` name, greedy (each task's own
    answer length, or `new_tokens`); returns the tasks and, per policy, its summary
    (`policy_summary`), the answers identical to dense and each task's outcome."""
    model, tok = load_model(ensure_model(args.model))
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    tasks = make_tasks(args.kinds.split(","), args.context_tokens, args.per_kind, args.seed, count)
    if new_tokens is not None:
        tasks = [dataclasses.replace(t, max_new_tokens=new_tokens) for t in tasks]
    print(f"[{args.name}] {len(tasks)} tasks x {len(policies)} policies", flush=True)
    outs = evaluate(model, tok, tasks, list(policies.values()), progress=True)
    table = {}
    for i, name in enumerate(policies):
        rows = outs[i :: len(policies)]
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
    return tasks, table


def save(args, summary: dict, table: dict, **config) -> None:
    """`benchmark/results/archive/<name>.json`: the summary, the table, the run's setup."""
    write_result(
        RESULTS / f"{args.name}.json",
        summary,
        {"policies": table},
        model=MODELS[args.model].name,
        context_tokens=args.context_tokens,
        kinds=args.kinds.split(","),
        per_kind=args.per_kind,
        seed=args.seed,
        **config,
    )
    print(summary)
