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

from study import parser, run, save

from sglang_psa.config import PSAConfig
from sglang_psa.hf.attention import DecodePolicy

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
    ap = parser(__doc__.split("\n\n")[0], "kept_selection_cpu_8k", seed=7)
    ap.add_argument("--interval", type=int, default=PSAConfig().rerank_interval)
    args = ap.parse_args()
    tasks, table = run(args, policies(args.interval), NEW_TOKENS)
    key = {"psa fresh": "psa_fresh", "psa kept": "psa_kept", "topk fresh": "topk_fresh",
           "topk kept": "topk_kept"}  # fmt: skip
    summary = {
        "n_tasks": len(tasks),
        "accuracy_dense": table["dense"]["accuracy"],
        **{f"identical_{key[n]}": table[n]["identical"] / len(tasks) for n in key},
        **{f"accuracy_{key[n]}": table[n]["accuracy"] for n in key},
        **{f"kv_fraction_{key[n]}": table[n]["kv_fraction"] for n in key},
    }
    save(args, summary, table, interval=args.interval, new_tokens=NEW_TOKENS)


if __name__ == "__main__":
    main()
