"""Why PSA's heuristic stop rule loses long-context tasks, and which simple variant fixes it.

    python benchmark/studies/stop_rule_study.py --context-tokens 16384 \
        --tasks doc_qa:0,niah_1key:0,doc_qa:1,niah_1key:1

One dense prefill per task; then greedy decodes under every candidate policy
(dense, PSA default, higher ε, more sink/recent blocks, Quest-bound ranking,
PSA's set ∪ a small top-k floor by Quest's bound, the true-mass oracle, top-k),
plus, per policy, teacher-forced logit margins along the dense answer (how far
each step is from flipping the greedy token). For tasks where default PSA
disagrees with dense, a diagnosis: per layer, the true softmax mass covered by
the blocks PSA read, whether the block(s) holding the answer's fact were read
and where the mean / bound criticality ranked them, and which layers flip the
first diverging token (PSA in one layer only, or everywhere but one layer).

Everything is composed from `sglang_psa.algo` inside this script: the union
policy and the diagnostics wrap `progressive_attention` as the transformers hook
sees it, and a per-layer switch wraps `PSARuntime.__call__`; library code is
unchanged. Writes benchmark/results/archive/stop_rule_cpu.json (+ .png).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

import sglang_psa.hf.attention as hfa
from sglang_psa.algo.attention import (
    SparseResult,
    attend,
    block_lse,
    token_scores,
    topk_attention,
    true_coverage,
)
from sglang_psa.algo.criticality import bound_logits, criticality
from sglang_psa.config import PSAConfig
from sglang_psa.eval.results import write_result
from sglang_psa.eval.runner import chat_parts, stop_ids
from sglang_psa.eval.tasks import make_tasks
from sglang_psa.hf.attention import DecodePolicy, PSARuntime, runtime
from sglang_psa.hf.decode import Session, load_model
from sglang_psa.models import DEFAULT_MODEL, MODELS, ensure_model

RESULTS = Path(__file__).resolve().parents[1] / "results" / "archive"

# ---------------------------------------------------------------------------
# Script-local plumbing: a union-with-top-k PSA variant, diagnostics, layer switch.

_orig_progressive = hfa.progressive_attention
_orig_call = PSARuntime.__call__


class Diag:
    """Per decode call (layer order), what the PSA set covered; `needle` = answer blocks."""

    def __init__(self, needle: list[int]) -> None:
        self.needle = needle
        self.rows: list[dict] = []


DIAG: Diag | None = None


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def progressive_variant(q, k, v, lengths, cfg: PSAConfig, meta=None, scale=None) -> SparseResult:
    """`progressive_attention`, optionally ∪ top-`floor_tokens` blocks by `floor_score`."""
    res = _orig_progressive(q, k, v, lengths, cfg, meta=meta, scale=scale)
    floor = cfg.extra.get("floor_tokens")
    sc = _scale(q, scale)
    if floor:
        fcfg = cfg.replace(score=cfg.extra.get("floor_score", "bound"))
        tk = topk_attention(q, k, v, lengths, fcfg, floor, meta=meta, scale=sc)
        read = res.read | tk.read
        out, lse = attend(token_scores(q, k, lengths, sc), v, read, cfg.block_size)
        res = SparseResult(out.to(q.dtype), read, lse, res.n_waves)
    if DIAG is not None:
        _diagnose_call(q, k, v, lengths, cfg, meta, sc, res)
    return res


def _diagnose_call(q, k, v, lengths, cfg, meta, sc, res: SparseResult) -> None:
    bs = cfg.block_size
    B, Hq, _ = q.shape
    Hkv = k.shape[1]
    cov = true_coverage(q, k, lengths, res.read, bs, scale=sc)[0]  # [Hq]
    nblk = int((lengths[0] + bs - 1) // bs)
    frac = res.read[0, :, :nblk].float().mean(-1)  # [Hkv]
    scores = token_scores(q, k, lengths, sc)
    blse = block_lse(scores, bs)[0]  # [Hq, NB]
    tot = torch.logsumexp(blse, -1)
    nd = torch.tensor(DIAG.needle, dtype=torch.long)
    needle_share = torch.exp(torch.logsumexp(blse[:, nd], -1) - tot)  # [Hq]
    needle_read = res.read[0][:, nd].any(-1)  # [Hkv]
    ranks = {}
    for method in ("mean", "bound"):
        crit = criticality(q, meta, sc, method)[0][:, :nblk]  # [Hkv, NB]
        best = crit[:, nd].amax(-1, keepdim=True)
        ranks[method] = (crit > best).sum(-1).tolist()  # 0 = ranked first
    # Needle's rank by true mass (group max share), for reference.
    share = (blse - tot[:, None]).view(Hkv, Hq // Hkv, -1).amax(1)[:, :nblk]
    ranks["true"] = (share > share[:, nd].amax(-1, keepdim=True)).sum(-1).tolist()
    # How far Quest's bound overshoots each block's true max logit (nats): a loose bound
    # ranks blocks by their key ranges rather than by their match with q.
    tmax = torch.nn.functional.pad(scores[0], (0, nblk * bs - scores.shape[-1]), value=-torch.inf)
    tmax = tmax.view(Hq, nblk, bs).amax(-1)
    slack = (bound_logits(q, meta, sc)[0][:, :nblk] - tmax)[torch.isfinite(tmax)]
    DIAG.rows.append(
        {
            "layer": runtime()._cur_layer,
            "coverage": cov.tolist(),
            "fraction": frac.tolist(),
            "needle_share": needle_share.tolist(),
            "needle_read": needle_read.tolist(),
            "needle_rank": ranks,
            "bound_slack_median": float(slack.median()),
        }
    )


def _call(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    self._cur_layer = module.layer_idx
    layers = self.policy.cfg.extra.get("layers")
    if (
        query.shape[2] == 1
        and self.policy.kind != "dense"
        and layers is not None
        and module.layer_idx not in layers
    ):
        with self.use(DecodePolicy("dense", self.policy.cfg)):
            return _orig_call(
                self, module, query, key, value, attention_mask, scaling, dropout, **kw
            )
    return _orig_call(self, module, query, key, value, attention_mask, scaling, dropout, **kw)


def install_patches() -> None:
    hfa.progressive_attention = progressive_variant
    PSARuntime.__call__ = _call


# ---------------------------------------------------------------------------
# Policies.


def psa(base: PSAConfig, **kw) -> DecodePolicy:
    extra = kw.pop("extra", {})
    cfg = base.replace(**kw)
    cfg = PSAConfig(**{f: getattr(cfg, f) for f in PSAConfig.field_names()}, extra=extra)
    return DecodePolicy("psa", cfg)


def candidate_policies() -> dict[str, DecodePolicy]:
    b = PSAConfig()
    u16 = {"floor_tokens": 16 * b.block_size, "floor_score": "bound"}
    u32 = {"floor_tokens": 32 * b.block_size, "floor_score": "bound"}
    return {
        "dense": DecodePolicy("dense", b),
        "(a) psa ε0.98 (default)": psa(b),
        "(b) psa ε0.99": psa(b, threshold=0.99),
        "(b) psa ε0.995": psa(b, threshold=0.995),
        "(c) psa ε0.98 sink2 recent4": psa(b, sink_blocks=2, recent_blocks=4),
        "(d) psa ε0.98 bound score": psa(b, score="bound"),
        "(e) psa ε0.98 ∪ top16 bound": psa(b, extra=u16),
        "(e) psa ε0.98 ∪ top32 bound": psa(b, extra=u32),
        "(d+e) psa ε0.98 bound ∪ top16 bound": psa(b, score="bound", extra=u16),
        "psa ε0.95 (default rule)": psa(b, threshold=0.95),
        "(d) psa ε0.95 bound score": psa(b, threshold=0.95, score="bound"),
        "(e) psa ε0.95 ∪ top16 bound": psa(b, threshold=0.95, extra=u16),
        "oracle ε0.98 (true-mass ranking)": DecodePolicy("oracle", b),
        "topk bound 512 tokens": DecodePolicy("topk", b.replace(score="bound"), 512),
        "topk bound 1024 tokens": DecodePolicy("topk", b.replace(score="bound"), 1024),
    }


# ---------------------------------------------------------------------------
# Decoding helpers (one session = one dense prefill).


def greedy(session: Session, policy: DecodePolicy, n: int, stop: set[int]):
    return session.decode(policy, n, stop)


def forced_logits(session: Session, policy: DecodePolicy, tokens: list[int]) -> list[torch.Tensor]:
    """Log-probabilities after the prefill and after feeding each of `tokens[:-1]` (teacher
    forced, `Session.forced_logprobs`); context unchanged. Entry i predicts tokens[i];
    entry 0 is the (dense) prefill's."""
    first = torch.log_softmax(session.next_logits.float(), -1)
    return [first, *session.forced_logprobs(policy, tokens)]


def margins(logits: list[torch.Tensor], tokens: list[int]) -> list[float]:
    """Per step: logit of the dense token minus the best other logit (< 0: greedy flips)."""
    out = []
    for lg, t in zip(logits, tokens):
        other = lg.clone()
        other[t] = -torch.inf
        out.append(float(lg[t] - other.max()))
    return out


def needle_blocks(tok, task, block_size: int) -> list[int]:
    """Blocks of the document that hold the sentence(s) containing an answer string."""
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": task.prompt + "\n\n\x00Q\x00"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    head = rendered.split("\x00Q\x00")[0]
    enc = tok(head, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    blocks: set[int] = set()
    for ans in task.answers:
        start = 0
        while (i := head.find(ans, start)) >= 0:
            s = max(head.rfind(".", 0, i), head.rfind("\n", 0, i)) + 1
            e = i + len(ans)
            for ti, (a, b) in enumerate(offsets):
                if b > s and a < e:
                    blocks.add(ti // block_size)
            start = e
    return sorted(blocks)


# ---------------------------------------------------------------------------


def summarize_diag(rows: list[dict], n_layers: int, eps: float) -> dict:
    """Per layer over steps: min/mean true coverage, share of heads below ε, needle stats."""
    per_layer = []
    for layer in range(n_layers):
        rs = [r for r in rows if r["layer"] == layer]
        if not rs:
            continue
        cov = torch.tensor([r["coverage"] for r in rs])  # [steps, Hq]
        ns = torch.tensor([r["needle_share"] for r in rs])
        per_layer.append(
            {
                "layer": layer,
                "coverage_min": float(cov.min()),
                "coverage_mean": float(cov.mean()),
                "heads_below_eps": float((cov < eps).float().mean()),
                "fraction_read": float(torch.tensor([r["fraction"] for r in rs]).mean()),
                "needle_share_max": float(ns.max()),
                "needle_read_all_steps_kv_heads": [
                    all(x) for x in zip(*(r["needle_read"] for r in rs))
                ],
                "needle_rank_mean": [r["needle_rank"]["mean"] for r in rs],
                "needle_rank_bound": [r["needle_rank"]["bound"] for r in rs],
                "needle_rank_true": [r["needle_rank"]["true"] for r in rs],
                "bound_slack_median_nats": float(
                    torch.tensor([r["bound_slack_median"] for r in rs]).median()
                ),
            }
        )
    return {"per_layer": per_layer}


def run_task(model, tok, task, pols: dict[str, DecodePolicy], stop, args) -> dict:
    global DIAG
    n_layers = model.config.num_hidden_layers
    doc_ids, q_ids = chat_parts(tok, task.prompt, task.question)
    t0 = time.time()
    session = Session(model, tok)
    session.extend(doc_ids + q_ids)
    prefill_s = time.time() - t0
    print(f"  prefill {session.length} tokens: {prefill_s:.0f} s", flush=True)
    needle = needle_blocks(tok, task, PSAConfig().block_size)
    res = {"kind": task.kind, "context_tokens": session.length, "needle_blocks": needle}
    res["prefill_s"] = prefill_s
    runs = {}
    dense = None
    t0 = time.time()
    for name, pol in pols.items():
        t1 = time.time()
        dec = greedy(session, pol, task.max_new_tokens, stop)
        if dense is None:
            dense = dec
        m = (
            []
            if args.no_margins
            else margins(forced_logits(session, pol, dense.tokens), dense.tokens)
        )
        runs[name] = {
            "output": dec.text,
            "correct": task.score(dec.text),
            "agrees_with_dense": dec.tokens == dense.tokens,
            "kv_fraction": dec.kv_fraction(),
            "layer_mean": [float(f.mean()) for _, f in sorted(dec.layer_fractions.items())],
            "forced_margins": m,
            "min_forced_margin": min(m[1:]) if len(m) > 1 else None,
            "seconds": time.time() - t1,
        }
        r = runs[name]
        print(
            f"  {name:40s} {r['output']!r:24s} ok={int(r['correct'])} "
            f"agree={int(r['agrees_with_dense'])} kv={r['kv_fraction']:.3f} "
            f"min_margin={r['min_forced_margin']}",
            flush=True,
        )
    res["decode_s"] = time.time() - t0
    res["runs"] = runs

    default = runs["(a) psa ε0.98 (default)"]
    if args.diagnose == "all" or (args.diagnose == "failing" and not default["agrees_with_dense"]):
        t0 = time.time()
        pol = pols["(a) psa ε0.98 (default)"]
        # Coverage along the dense trajectory (teacher-forced), default PSA everywhere.
        DIAG = Diag(needle)
        forced_logits(session, pol, dense.tokens)
        rows = DIAG.rows
        DIAG = None
        diag = summarize_diag(rows, n_layers, pol.cfg.threshold)
        # The first step where PSA's teacher-forced greedy token differs from dense.
        lg = forced_logits(session, pol, dense.tokens)
        flip = next(
            (i for i, (x, t) in enumerate(zip(lg, dense.tokens)) if int(x.argmax()) != t), None
        )
        diag["first_flip_step"] = flip
        if flip is not None:
            psa_tok = int(lg[flip].argmax())
            dense_tok = dense.tokens[flip]
            diag["flip_tokens"] = {
                "dense": tok.decode([dense_tok]),
                "psa": tok.decode([psa_tok]),
            }
            prefix = dense.tokens[: flip + 1]

            def pair_margin(p: DecodePolicy) -> float:
                x = forced_logits(session, p, prefix)[flip]
                return float(x[dense_tok] - x[psa_tok])

            base = pol.cfg
            only, but = [], []
            for layer in range(n_layers):
                only.append(pair_margin(psa(base, extra={"layers": [layer]})))
                rest = [i for i in range(n_layers) if i != layer]
                but.append(pair_margin(psa(base, extra={"layers": rest})))
            diag["flip_margin_dense"] = pair_margin(pols["dense"])
            diag["flip_margin_psa"] = pair_margin(pol)
            diag["flip_margin_psa_only_layer"] = only
            diag["flip_margin_psa_all_but_layer"] = but
            # Layers whose coverage alone (PSA in the first n layers) first flips the token.
            cum = []
            for n in range(1, n_layers + 1):
                cum.append(pair_margin(psa(base, extra={"layers": list(range(n))})))
            diag["flip_margin_psa_first_n_layers"] = cum
        diag["diagnose_s"] = time.time() - t0
        res["diagnosis"] = diag
        print(f"  diagnosis: first flip at step {flip}, {diag['diagnose_s']:.0f} s", flush=True)
    return res


def diagnosis_summary(t: dict) -> dict:
    """The failing task in a few numbers: where the flip comes from, what PSA covered."""
    dg = t["diagnosis"]
    pl = dg["per_layer"]
    eps = PSAConfig().threshold
    out = {
        "needle_blocks": t["needle_blocks"],
        "first_flip_step": dg.get("first_flip_step"),
        "flip_tokens": dg.get("flip_tokens"),
        "share_of_heads_below_eps": sum(r["heads_below_eps"] for r in pl) / len(pl),
        "layers_min_true_coverage_below_0.5": [
            (r["layer"], round(r["coverage_min"], 3)) for r in pl if r["coverage_min"] < 0.5
        ],
        "layers_needle_share_ge_0.1_needle_unread": [
            (r["layer"], round(r["needle_share_max"], 3))
            for r in pl
            if r["needle_share_max"] >= 0.1 and not all(r["needle_read_all_steps_kv_heads"])
        ],
        "eps": eps,
    }
    if dg.get("first_flip_step") is not None:
        only = dg["flip_margin_psa_only_layer"]
        out["flip_margin_dense"] = dg["flip_margin_dense"]
        out["flip_margin_psa"] = dg["flip_margin_psa"]
        out["layers_flipping_alone"] = [i for i, m in enumerate(only) if m < 0]
        out["layers_cutting_margin_most"] = sorted(range(len(only)), key=lambda i: only[i])[:5]
        cum = dg["flip_margin_psa_first_n_layers"]
        out["flips_once_psa_in_layers_0_to"] = next((i for i, m in enumerate(cum) if m < 0), None)
    return out


def aggregate(tasks_out: list[dict], names: list[str]) -> dict:
    table = {}
    for name in names:
        rows = [t["runs"][name] for t in tasks_out]
        mm = [r["min_forced_margin"] for r in rows if r["min_forced_margin"] is not None]
        table[name] = {
            "accuracy": sum(r["correct"] for r in rows) / len(rows),
            "agreement_with_dense": sum(r["agrees_with_dense"] for r in rows) / len(rows),
            "kv_fraction": sum(r["kv_fraction"] for r in rows) / len(rows),
            "min_forced_margin": min(mm) if mm else None,
            "outputs": {
                t["kind"] + f"#{i}": t["runs"][name]["output"] for i, t in enumerate(tasks_out)
            },
        }
    return table


def plot(table: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    markers = "os^vP*Xhp<>d"
    for i, (name, r) in enumerate(table.items()):
        ax.plot(
            max(r["kv_fraction"], 1e-3),
            r["agreement_with_dense"],
            "D" if name == "dense" else markers[i % len(markers)],
            color=plt.cm.tab20(i % 20),
            markersize=8,
            label=f"{name} (acc {r['accuracy']:.2f})",
            alpha=0.8,
        )
    ax.set_xscale("log")
    ax.set_xlabel("mean fraction of KV blocks read (log)")
    ax.set_ylabel("agreement with dense (identical greedy tokens)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def token_counter(tok):
    return lambda s: len(tok(s, add_special_tokens=False)["input_ids"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--context-tokens", type=int, default=16384)
    ap.add_argument(
        "--tasks",
        default="doc_qa:0,niah_1key:0",
        help="comma-separated kind:index (index as in make_tasks with per-kind > index)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--diagnose", choices=("failing", "all", "none"), default="failing")
    ap.add_argument("--name", default="stop_rule_cpu")
    ap.add_argument(
        "--no-margins", action="store_true", help="skip the teacher-forced margins (faster)"
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the tasks already in the result file and add the missing ones",
    )
    args = ap.parse_args()

    install_patches()
    specs = [(s.split(":")[0], int(s.split(":")[1])) for s in args.tasks.split(",")]
    model = tok = count = stop = None
    pols = candidate_policies()
    names = list(pols)
    tasks_out = []
    args.prev_commands = []
    path = RESULTS / f"{args.name}.json"
    if args.resume and path.exists():
        prev = json.loads(path.read_text())
        tasks_out = prev["data"]["tasks"]
        args.prev_commands = prev.get("commands", [prev["command"]])
        print(f"resuming with {len(tasks_out)} task(s) from {path}", flush=True)
    done = {(t["kind"], t["index"]) for t in tasks_out}
    for kind, idx in specs:
        if (kind, idx) in done:
            continue
        if model is None:
            model, tok = load_model(ensure_model(args.model), device="cpu")
            count = token_counter(tok)
            stop = stop_ids(tok)
        task = make_tasks([kind], args.context_tokens, idx + 1, args.seed, count)[idx]
        print(f"task {kind}#{idx}: answers {task.answers}", flush=True)
        out = run_task(model, tok, task, pols, stop, args)
        out["index"] = idx
        tasks_out.append(out)
        write(tasks_out, names, args)  # after every task, so a cut-off run leaves results
    table = write(tasks_out, names, args)
    print(f"\n{'policy':40s} {'acc':>5s} {'agree':>6s} {'kv_frac':>8s} {'min_margin':>10s}")
    for name, r in table.items():
        mm = r["min_forced_margin"]
        print(
            f"{name:40s} {r['accuracy']:5.2f} {r['agreement_with_dense']:6.2f} "
            f"{r['kv_fraction']:8.4f} {mm if mm is None else round(mm, 2)!s:>10s}"
        )


def write(tasks_out: list[dict], names: list[str], args) -> dict:
    table = aggregate(tasks_out, names)
    ctx = round(sum(t["context_tokens"] for t in tasks_out) / len(tasks_out))
    key = {
        "default_098": "(a) psa ε0.98 (default)",
        "eps_099": "(b) psa ε0.99",
        "eps_0995": "(b) psa ε0.995",
        "sink2_recent4_098": "(c) psa ε0.98 sink2 recent4",
        "bound_score_098": "(d) psa ε0.98 bound score",
        "union_top16_bound_098": "(e) psa ε0.98 ∪ top16 bound",
        "union_top32_bound_098": "(e) psa ε0.98 ∪ top32 bound",
        "bound_union_top16_098": "(d+e) psa ε0.98 bound ∪ top16 bound",
        "oracle_098": "oracle ε0.98 (true-mass ranking)",
    }
    summary = {
        "context_tokens": ctx,
        "n_tasks": len(tasks_out),
        "tasks": [f"{t['kind']}#{t['index']}" for t in tasks_out],
        "accuracy_dense": table["dense"]["accuracy"],
    }
    for k, name in key.items():
        summary[f"accuracy_{k}"] = table[name]["accuracy"]
        summary[f"agreement_{k}"] = table[name]["agreement_with_dense"]
        summary[f"kv_fraction_{k}"] = table[name]["kv_fraction"]
    for t in tasks_out:
        if "diagnosis" in t:
            summary[f"diagnosis_{t['kind']}#{t['index']}"] = diagnosis_summary(t)
    write_result(
        RESULTS / f"{args.name}.json",
        summary,
        {"policies": table, "tasks": tasks_out},
        model=MODELS[args.model].name,
        seed=args.seed,
        commands=[*args.prev_commands, " ".join(["python", *sys.argv])],
    )
    plot(
        table,
        RESULTS / f"{args.name}.png",
        f"{args.model}, {ctx} tokens, {len(tasks_out)} tasks: stop-rule variants (cpu)",
    )
    print(f"wrote {RESULTS / f'{args.name}.json'}", file=sys.stderr)
    return table


if __name__ == "__main__":
    main()
