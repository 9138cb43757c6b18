"""How good is each block-criticality estimate at ordering blocks by their true mass?

    python benchmark/studies/ranking_study.py --model smollm2-135m --context-tokens 4096
    python benchmark/studies/ranking_study.py --model qwen2.5-0.5b --context-tokens 8192

PSA reads blocks in estimated-criticality order and stops once the mass it
believes covered passes ε; when the estimate misorders blocks, the stop rule
stops with too little true mass (see `stop_rule_study.py`). This study takes
the stop rule out: for real decode queries (captured at the first `--steps`
decode steps of generated tasks, every layer) it reports, per estimate, the
fraction of blocks that must be read in that estimate's order (forced sink and
recent blocks first) until every query head of a KV head's group has ε of its
true softmax mass. The oracle (true-mass order) is the floor. Estimates:
`mean` (q · block mean key), `bound` (Quest's min/max bound), and `sub4`
(q · mean key of each quarter-block, max over the quarters: 4x the metadata).
It also scores two stop rules at ε on the same queries by the true mass they
cover: PSA's heuristic (the library's `progressive_attention`, default
config) and stopping once the bound's *estimated* shares of the blocks read
pass ε. Writes benchmark/results/<name>.json with the mean fraction per
estimate and per layer, and per rule the fraction read, the smallest true
coverage of a group and the share of groups below ε.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch

import sglang_psa.hf.attention as hf_attention
from sglang_psa.algo.attention import block_lse, token_scores
from sglang_psa.algo.criticality import bound_logits, criticality
from sglang_psa.algo.metadata import block_metadata, num_blocks
from sglang_psa.config import PSAConfig
from sglang_psa.eval.results import write_result
from sglang_psa.eval.runner import chat_parts
from sglang_psa.eval.tasks import GENERATORS, make_tasks
from sglang_psa.hf.attention import DecodePolicy
from sglang_psa.hf.decode import Session, load_model
from sglang_psa.models import DEFAULT_MODEL, MODELS, ensure_model

RESULTS = Path(__file__).resolve().parents[1] / "results" / "archive"
ESTIMATES = ("oracle", "mean", "bound", "sub4")


def estimate(name: str, q, k, lengths, meta, bs: int, scale: float, true_share) -> torch.Tensor:
    """`[B, Hkv, NB]` criticality (higher = read earlier); `meta` is the blocks' metadata."""
    Hkv = k.shape[1]
    if name == "oracle":
        B, Hq, NB = true_share.shape
        return true_share.view(B, Hkv, Hq // Hkv, NB).amax(2)
    if name in ("mean", "bound"):
        return criticality(q, meta, scale, name)
    sub = bs // 4
    c = criticality(q, block_metadata(k, lengths, sub), scale, "mean")  # [B, Hkv, 4 NB]
    nb = int(num_blocks(lengths, bs).max())
    c = torch.nn.functional.pad(c, (0, nb * 4 - c.shape[-1]), value=-torch.inf)
    return c.view(*c.shape[:2], nb, 4).amax(-1)


def _ordered_cum(order_key, log_share, lengths, cfg: PSAConfig):
    """Cumulative shares `[B, Hkv, G, NB]` in `order_key` order, forced blocks first."""
    B, Hkv, NB = order_key.shape
    G = log_share.shape[1] // Hkv
    nblk = num_blocks(lengths, cfg.block_size)
    idx = torch.arange(NB)[None, :]
    forced = (idx < cfg.sink_blocks) | (idx >= nblk[:, None] - cfg.recent_blocks)
    key = torch.where(forced[:, None, :], torch.inf, order_key)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # [B, Hkv, NB]
    share = log_share.exp().view(B, Hkv, G, NB)
    return share.gather(-1, order[:, :, None, :].expand(B, Hkv, G, NB)).cumsum(-1)


def _first_covered(cum, eps: float) -> torch.Tensor:
    """Blocks read `[B, Hkv]` until every head of the group has `eps` (>= 1)."""
    ok = (cum >= eps).all(2)
    return ok.float().argmax(-1) + 1


def needed_fraction(order_key, true_share, lengths, cfg: PSAConfig, eps: float):
    """Per (request, KV head): fraction of blocks read, in `order_key` order with forced
    blocks first, until every query head of the group has covered `eps` of its mass."""
    n = _first_covered(_ordered_cum(order_key, true_share, lengths, cfg), eps)
    return n.float() / num_blocks(lengths, cfg.block_size)[:, None].float()


def estimated_stop(q, meta, lengths, cfg: PSAConfig, scale, true_share, eps: float):
    """Stop once the *estimated* shares (bound logits + log count, normalised per head)
    of the blocks read pass `eps`: fraction read and each group's min true coverage."""
    est = bound_logits(q, meta, scale) + meta.count.clamp(min=1).log()[:, None, :]
    est = est.masked_fill((meta.count == 0)[:, None, :], -torch.inf)
    est = est - torch.logsumexp(est, -1, keepdim=True)
    key = criticality(q, meta, scale, "bound")
    n = _first_covered(_ordered_cum(key, est, lengths, cfg), eps)  # [B, Hkv]
    cum_true = _ordered_cum(key, true_share, lengths, cfg)
    cov = cum_true.gather(-1, (n - 1)[:, :, None, None].expand(*cum_true.shape[:3], 1))
    nblk = num_blocks(lengths, cfg.block_size)[:, None].float()
    return n.float() / nblk, cov.squeeze(-1).amin(-1)


class Capture:
    """Scores the estimates on every decode call of the transformers hook."""

    def __init__(self, cfg: PSAConfig, eps: float, n_layers: int):
        self.cfg, self.eps, self.n_layers = cfg, eps, n_layers
        self.per_layer: dict[str, dict[int, list[float]]] = {
            e: defaultdict(list) for e in ESTIMATES
        }
        self.rules: dict[str, dict[int, list[tuple[float, float, float]]]] = {
            r: defaultdict(list) for r in ("heuristic", "estimated_bound")
        }
        self.layer = 0
        self.original = hf_attention.progressive_attention

    def __call__(self, q, k, v, lengths, cfg, meta=None, scale=None):
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        bs = self.cfg.block_size
        blse = block_lse(token_scores(q, k, lengths, scale), bs)
        true_share = blse - torch.logsumexp(blse, -1, keepdim=True)  # [B, Hq, NB]
        block_meta = block_metadata(k, lengths, bs)
        for name in ESTIMATES:
            key = estimate(name, q, k, lengths, block_meta, bs, scale, true_share)
            frac = needed_fraction(key, true_share, lengths, self.cfg, self.eps)
            self.per_layer[name][self.layer].extend(frac.flatten().tolist())
        # Stop rules at ε, scored by the true mass they cover (min over each group's heads).
        res = self.original(
            q, k, v, lengths, self.cfg.replace(threshold=self.eps), meta=block_meta, scale=scale
        )
        readq = res.read.repeat_interleave(q.shape[1] // k.shape[1], 1)
        cov = torch.logsumexp(true_share.masked_fill(~readq, -torch.inf), -1).exp()
        cov = cov.view(*res.read.shape[:2], -1).amin(-1)
        nblk = num_blocks(lengths, bs)[:, None].float()
        rules = {
            "heuristic": (res.read.sum(-1).float() / nblk, cov),
            "estimated_bound": estimated_stop(
                q, block_meta, lengths, self.cfg, scale, true_share, self.eps
            ),
        }
        for name, (frac, cov) in rules.items():
            self.rules[name][self.layer].append(
                (frac.mean().item(), cov.min().item(), (cov < self.eps).float().mean().item())
            )
        self.layer = (self.layer + 1) % self.n_layers
        return self.original(q, k, v, lengths, cfg, meta=meta, scale=scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--context-tokens", type=int, default=8192)
    ap.add_argument("--kinds", default="niah_1key,niah_4key,variable_tracking,doc_qa")
    ap.add_argument("--per-kind", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="decode steps captured per task")
    ap.add_argument("--eps", type=float, default=0.98)
    ap.add_argument("--name", default=None, help="default: ranking_cpu_<model>")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in GENERATORS]
    if unknown:
        ap.error(f"--kinds: unknown {', '.join(unknown)} (choose from {', '.join(GENERATORS)})")
    model, tok = load_model(ensure_model(args.model))
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    tasks = make_tasks(kinds, args.context_tokens, args.per_kind, args.seed, count)
    cfg = PSAConfig(threshold=1.0)  # reads everything: the decode is dense attention
    cap = Capture(PSAConfig(), args.eps, model.config.num_hidden_layers)
    hf_attention.progressive_attention = cap
    try:
        for i, task in enumerate(tasks, 1):
            doc, q = chat_parts(tok, task.prompt, task.question)
            session = Session(model, tok)
            session.extend(doc + q)
            print(
                f"[ranking] task {i}/{len(tasks)} {task.kind}: {session.length} tokens", flush=True
            )
            cap.layer = 0
            session.decode(DecodePolicy("psa", cfg), args.steps + 1)
    finally:
        hf_attention.progressive_attention = cap.original
    per_layer = {
        e: [sum(v) / len(v) for _, v in sorted(cap.per_layer[e].items())] for e in ESTIMATES
    }
    summary = {f"blocks_needed_{e}": sum(per_layer[e]) / len(per_layer[e]) for e in ESTIMATES}
    rules = {}
    for r, by_layer in cap.rules.items():
        rows = [x for _, v in sorted(by_layer.items()) for x in v]
        rules[r] = {
            "fraction_read": sum(x[0] for x in rows) / len(rows),
            "min_true_coverage": min(x[1] for x in rows),
            "groups_below_eps": sum(x[2] for x in rows) / len(rows),
            "per_layer_min_coverage": [min(x[1] for x in v) for _, v in sorted(by_layer.items())],
        }
        summary[f"{r}_fraction_read"] = rules[r]["fraction_read"]
        summary[f"{r}_groups_below_eps"] = rules[r]["groups_below_eps"]
    summary["n_tasks"] = len(tasks)
    name = args.name or f"ranking_cpu_{args.model.replace('.', '').replace('-', '_')}"
    write_result(
        RESULTS / f"{name}.json",
        summary,
        {"per_layer": per_layer, "stop_rules": rules},
        model=MODELS[args.model].name,
        context_tokens=args.context_tokens,
        kinds=kinds,
        eps=args.eps,
        steps=args.steps,
    )
    print(summary)


if __name__ == "__main__":
    main()
