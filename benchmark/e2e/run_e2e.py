"""SGLang with and without `--sparse-mode psa`, same prompts, same GPU -> e2e_h100.json.

PYTHONPATH=python:sgl-kernel-ext python benchmark/e2e/run_e2e.py --model qwen2.5-0.5b

Runs plain SGLang (triton attention, no CUDA graphs) and then the plugin
(`sparse_mode="psa"`) as in-process `sgl.Engine`s, one after the other:

- greedy agreement at ε = 1: 48-token greedy completions of generated
  long-context prompts and short raw prompts, identical or not; where they
  differ, whether the first differing step was a near-tie in plain SGLang's
  top log-probabilities; first-token log-probabilities compared;
- the same agreement between plain SGLang and plain SGLang with a different
  number of KV splits in its decode kernel (`plain_splits`): how far two
  correct dense kernels that round differently already part ways on this
  model, the yardstick for the ε = 1 figure;
- accuracy of the generated long-context tasks (`benchmark/accuracy/`), plain
  (dense) vs PSA at ε = 0.98;
- 64 concurrent requests of mixed lengths: all complete, and the PSA
  admission controller is back to idle (no running or paused request);
- a request larger than the host tier: a clear error, then a normal request.

Every sglang-psa run uses the tiered home (`--psa-kv-home tiered`: SGLang's
pool in HBM, every full block also written back to a host tier sized to the
longest task plus room), so the host tier is what refuses the oversized request.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from sglang_psa.config import PSAConfig
from sglang_psa.eval.agreement import DEFAULT_TIE, compare, greedy
from sglang_psa.eval.results import git_commit, machine, write_result
from sglang_psa.eval.runner import chat_parts
from sglang_psa.eval.tasks import make_tasks
from sglang_psa.models import DEFAULT_MODEL, MODELS, ensure_model, kv_bytes_per_token

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmark" / "results" / "archive"
RAW_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a village by the sea,",
    "The three laws of thermodynamics state that",
)
BLOCK = PSAConfig().block_size  # --psa-block-size default: plain SGLang's page size too
RUNS = ("plain", "plain_splits", "psa_1", "psa_098")  # in the order they run
SPLITS = 16  # plain_splits: SGLang's triton decode kernel with 16 KV splits (default 8)
KINDS = ("niah_1key", "niah_4key", "variable_tracking", "doc_qa")


def engine(model_dir: str, psa: dict | None, **extra):
    import sglang as sgl

    kw = dict(
        model_path=model_dir,
        attention_backend="triton",
        sampling_backend="pytorch",
        mem_fraction_static=0.5,
        log_level="error",
        random_seed=0,
        **extra,
    )
    if psa is None:  # the same pages and no CUDA graphs, as --sparse-mode psa sets
        kw.update(
            page_size=BLOCK,
            cuda_graph_backend_decode="disabled",
            cuda_graph_backend_prefill="disabled",
        )
    else:
        kw.update(psa)
    return sgl.Engine(**kw)


def exercise(eng, w: dict, psa: bool) -> dict:
    """One engine through the whole workload `w` (prompts built in `main`)."""
    t0 = time.time()
    out = {"greedy": greedy(eng, w["greedy_prompts"], 48)}
    answers = greedy(eng, w["task_ids"], max(t.max_new_tokens for t in w["tasks"]))
    out["accuracy"] = sum(t.score(a["text"]) for t, a in zip(w["tasks"], answers)) / len(w["tasks"])
    outs = eng.generate(
        input_ids=w["mixed"], sampling_params={"temperature": 0, "max_new_tokens": 32}
    )
    reasons = [o["meta_info"]["finish_reason"]["type"] for o in outs]
    out["concurrent_completed"] = sum(r in ("length", "stop") for r in reasons)
    if psa:
        # Idle again: nothing admitted or paused, no KV page held outside the prefix cache.
        state = eng.get_server_info()["internal_states"][0]["psa"]
        out["idle_state"] = state
        out["leaked"] = state["running"] + state["paused"] + state["kv_held_tokens"]
        try:  # within the model's context, beyond the host pool
            eng.generate(input_ids=w["oversized"], sampling_params={"max_new_tokens": 4})
            out["oversized_error"] = None
        except ValueError as e:
            out["oversized_error"] = str(e)
        after = eng.generate(
            prompt="The capital of France is", sampling_params={"max_new_tokens": 4}
        )
        out["served_after_error"] = bool(after["text"])
    out["wall_s"] = time.time() - t0
    return out


def runs_provenance(results: dict[str, dict]) -> dict[str, dict]:
    """Each engine run's own command, commit, machine and date. Runs spread over calls
    may differ in commit or machine: allowed, but said out loud, never mixed silently."""
    origin = {name: r.get("provenance", {}) for name, r in results.items()}
    for field in ("git_commit", "machine"):
        seen = {o.get(field, "unknown") for o in origin.values()}
        if len(seen) > 1:
            print(f"[e2e] warning: the engine runs differ in {field}: {sorted(seen)}")
    return origin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--context-tokens", type=int, default=6144)
    ap.add_argument("--per-kind", type=int, default=3)
    ap.add_argument("--name", default="e2e_h100")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument(
        "--tie", type=float, default=DEFAULT_TIE, help="near-tie: top-2 logprob gap (nats)"
    )
    ap.add_argument("--runs", default=",".join(RUNS), help="engines to run")
    ap.add_argument(
        "--parts", default=str(REPO / "build" / "e2e_parts"), help="per-engine results kept here"
    )
    args = ap.parse_args()
    runs = args.runs.split(",")
    unknown = [n for n in runs if n not in RUNS]
    if unknown:  # before the model loads or any engine starts
        ap.error(f"--runs: unknown run(s) {', '.join(unknown)} (choose from {', '.join(RUNS)})")
    from transformers import AutoTokenizer

    model_dir = str(ensure_model(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    tasks = make_tasks(list(KINDS), args.context_tokens, args.per_kind, 1, count)
    task_ids = [sum(chat_parts(tok, t.prompt, t.question), []) for t in tasks]
    # The host tier holds the longest task plus room; a prompt just beyond it is refused.
    pool_tokens = max(len(t) for t in task_ids) + 1024
    per_token = kv_bytes_per_token(model_dir)
    host_gb = pool_tokens * per_token / 2**30
    filler = tok(" word" * (pool_tokens + 512), add_special_tokens=False)["input_ids"]
    w = {
        "tasks": tasks,
        "task_ids": task_ids,
        "greedy_prompts": task_ids + [tok(p)["input_ids"] for p in RAW_PROMPTS],
        # Mixed lengths up to half the host tier: together far beyond it, each within it.
        "mixed": [
            tok(" ".join(["word"] * (50 + (pool_tokens // 2 - 50) * i // 63)))["input_ids"]
            for i in range(64)
        ],
        "oversized": filler[: pool_tokens + 512],
    }
    data: dict = {
        "model": args.model,
        "context_tokens": args.context_tokens,
        "host_pool_gb": host_gb,
        "host_pool_tokens": pool_tokens,
    }

    def run(psa: dict | None, extra: dict) -> dict:
        eng = engine(model_dir, psa, **extra)
        try:
            return exercise(eng, w, psa is not None)
        finally:
            eng.shutdown()

    common = {"sparse_mode": "psa", "psa_kv_home": "tiered", "psa_host_pool_gb": host_gb}
    configs = {  # keys: RUNS
        "plain": None,
        "plain_splits": None,
        "psa_1": {**common, "psa_threshold": 1.0},
        "psa_098": {**common, "psa_threshold": 0.98},
    }
    # Each engine's results are kept in --parts, so the runs can be spread over calls
    # (`--runs plain,plain_splits,psa_1`, then the rest); the summary needs them all.
    parts = Path(args.parts)
    parts.mkdir(parents=True, exist_ok=True)
    for name in runs:
        t0 = time.time()
        print(f"[e2e] {name}: starting an engine", flush=True)
        extra = {"triton_attention_num_kv_splits": SPLITS} if name == "plain_splits" else {}
        result = run(configs[name], extra)
        result["provenance"] = {  # parts may come from several calls: each says its own
            "command": shlex.join(["python3", *sys.argv]),
            "git_commit": git_commit(),
            "machine": machine(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        (parts / f"{name}.json").write_text(json.dumps(result))
        print(f"[e2e] {name}: done in {time.time() - t0:.0f} s", flush=True)
    got = {n: parts / f"{n}.json" for n in configs}
    missing = [n for n, f in got.items() if not f.exists()]
    if missing:
        print(f"[e2e] not yet run: {', '.join(missing)} (rerun with --runs {','.join(missing)})")
        return
    plain, splits, exact, psa98 = (json.loads(got[n].read_text()) for n in configs)
    origin = runs_provenance(dict(zip(configs, (plain, splits, exact, psa98))))
    data.update(
        runs_provenance=origin,
        plain=plain,
        plain_splits=splits,
        greedy_plain_vs_plain_splits=compare(plain["greedy"], splits["greedy"], args.tie),
        psa_1=exact,
        psa_098=psa98,
        greedy_at_1=compare(plain["greedy"], exact["greedy"], args.tie),
        greedy_at_098=compare(plain["greedy"], psa98["greedy"], args.tie),
    )
    summary = {
        "greedy_match_at_threshold_1": data["greedy_at_1"]["fraction_identical"],
        "accuracy_dense": plain["accuracy"],
        "accuracy_psa_098": psa98["accuracy"],
        "greedy_match_plain_vs_plain_splits": data["greedy_plain_vs_plain_splits"][
            "fraction_identical"
        ],
        "leaked_blocks_after_load": psa98["leaked"],
        "concurrent_completed_psa": psa98["concurrent_completed"],
    }
    write_result(
        Path(args.out) / f"{args.name}.json",
        summary,
        data,
        note="decode through the wave kernel over SGLang's KV pages in HBM, every full "
        "block also written to the host tier; leaks: requests still admitted or paused "
        "plus KV tokens neither free nor cached",
    )
    print(summary)


if __name__ == "__main__":
    main()
