"""Can a certified stop rule read at most half the KV once its bound is tight enough?

    python benchmark/studies/certified_bound_study.py --context-tokens 4096 --steps 3 \
        --name certified_bound_cpu_4k
    python benchmark/studies/certified_bound_study.py --context-tokens 16384 --steps 4

The certified rule stops once the mass the unread blocks could hold is at most
(1 - ε) / ε of the true mass read, for every query head of a KV head's group, so
each head keeps ≥ ε of its softmax mass. With the box bound of the block key
min/max (count × exp of Quest's bound) it reads every block on the real model
(adaptive_budget.json, psa-certified-0.95). This study bounds the unread mass with
per-token low-bit key codes instead (`sglang_psa.algo.token_bounds`: each token's
key cell per channel, `bits` bits a channel): Σ over the block's tokens of exp of
each token's interval bound. On real decode queries (captured as in
`ranking_study.py`: the first `--steps` decode steps of generated tasks, every
layer, dense decode) it scores, per ε, one block at a time (no waves):

- `oracle`: true-mass order, stop once every head has ε of its true mass (the floor;
  not a policy, reads no metadata);
- `box`: the library's certified bound, blocks in Quest-bound criticality order;
- `box_waves`: the library's certified rule itself (`progressive_attention`, its
  default waves and first wave);
- `codes<b>`: the code bound, blocks in descending order of their bounded mass
  (each head's share of the group's bounded mass, max over the group, as
  `criticality_from_logits`), forced sink/recent blocks first;
- `alloc<b>`: the same with per-channel widths averaging `b` bits, fixed per layer and
  KV head (`allocate_bits`) from a calibration task of another kind (`--calib-kind`,
  not scored): the channels whose `|q_i| (kmax_i - kmin_i)` is typically large get
  the bits. Same bytes as `codes<b>`.

KV fraction = blocks read / blocks, plus every byte the rule reads for all blocks:
the 8-bit key min/max (136 B a block and KV head: 2 × 64 codes + two float32 scales,
as `mem_cache.kv_budget.metadata_bytes_per_token` counts them) and the codes
(`bits` × head_dim / 8 B a token), against K+V's 2 × head_dim × 2 B a token. Every
token's bound is asserted to be at least its true score (float32 and float64) and
every certified rule's true coverage to be at least ε. Writes
benchmark/results/<name>.json: per rule/ε the mean KV and block fractions and the
smallest true coverage of any query head.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict
from pathlib import Path

import torch

import sglang_psa.hf.attention as hf_attention
from sglang_psa.algo.attention import block_lse, forced_blocks, order_blocks, token_scores
from sglang_psa.algo.criticality import bound_logits, criticality, criticality_from_logits
from sglang_psa.algo.metadata import as_kept, block_metadata, num_blocks
from sglang_psa.algo.token_bounds import (
    allocate_bits,
    code_bytes_per_token,
    encode_keys,
    token_score_bounds,
)
from sglang_psa.config import PSAConfig
from sglang_psa.eval.results import write_result
from sglang_psa.eval.runner import chat_parts
from sglang_psa.eval.tasks import GENERATORS, make_tasks
from sglang_psa.hf.attention import DecodePolicy
from sglang_psa.hf.decode import Session, load_model
from sglang_psa.models import DEFAULT_MODEL, MODELS, ensure_model

RESULTS = Path(__file__).resolve().parents[1] / "results" / "archive"
KV_ELEM_BYTES = 2  # bf16


def meta_bytes_per_block(head_dim: int) -> int:
    """8-bit key min/max of one block and KV head, as the plugin sizes them."""
    return 2 * head_dim + 4 * max(1, head_dim // 32)


def exact_scores(q, k, lengths, scale: float) -> torch.Tensor:
    """`scale * q . k` in float64 (exact products of the float32/bf16 inputs), `[B, Hq, T]`,
    -inf past each length: the true scores coverage is measured on."""
    B, Hq, d = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    qg = q.double().view(B, Hkv, Hq // Hkv, d)
    s = torch.einsum("bhgd,bhtd->bhgt", qg, k.double()).flatten(1, 2) * scale
    pad = torch.arange(T)[None, :] >= lengths[:, None]
    return s.masked_fill(pad[:, None, :], -torch.inf)


def certified_stop(order, true_blse, bound_blse, lengths, cfg: PSAConfig, eps: float):
    """One block at a time in `order [B, Hkv, NB]` (forced blocks first): blocks read
    `[B, Hkv]` at the first prefix where, for every head of the group, the bounded mass of
    the unread blocks is ≤ (1 - ε) / ε × the true mass read, and each head's true coverage
    `[B, Hq]` there. `*_blse [B, Hq, NB]` are log block masses (float64)."""
    B, Hkv, nb = order.shape
    G = true_blse.shape[1] // Hkv
    oq = order.repeat_interleave(G, 1)
    covered = torch.logcumsumexp(true_blse.gather(-1, oq), -1)
    tail = torch.logcumsumexp(bound_blse.gather(-1, oq).flip(-1), -1).flip(-1)
    unread = torch.cat([tail[..., 1:], torch.full_like(tail[..., :1], -torch.inf)], -1)
    ok = (unread - covered) <= math.log((1 - eps) / eps)
    pos = torch.arange(nb)
    nblk = num_blocks(lengths, cfg.block_size)
    n_forced = forced_blocks(lengths, nb, cfg).sum(-1)
    may = (pos[None, :] >= n_forced[:, None] - 1) & (pos[None, :] < nblk[:, None])
    stop = ok.view(B, Hkv, G, nb).all(2) & may[:, None, :]
    first = torch.where(stop, pos, (nblk - 1)[:, None, None]).amin(-1)  # last block: all read
    firstq = first.repeat_interleave(G, 1)[..., None]
    cov = (covered.gather(-1, firstq)[..., 0] - torch.logsumexp(true_blse, -1)).exp()
    return first + 1, cov


class Capture:
    """Scores every rule on every decode call of the transformers hook (dense decode)."""

    def __init__(self, eps: list[float], widths: dict[str, int | list], n_layers: int):
        """`widths`: code rule -> bits a channel, or per layer `[Hkv, d]` widths."""
        self.cfg = PSAConfig()
        self.eps, self.widths, self.n_layers = eps, widths, n_layers
        self.rules = ["oracle", "box", "box_waves", *widths]
        # (rule, eps) -> layer -> [(blocks fraction per KV head..., min coverage)]
        self.frac: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.cov: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        # bits -> per head log(Σ bound mass / Σ true mass) over the whole context
        self.slack: dict[str, list[float]] = defaultdict(list)
        self.calls = 0
        self.original = hf_attention.progressive_attention

    def __call__(self, q, k, v, lengths, cfg, meta=None, scale=None, **kwargs):
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        layer = self.calls % self.n_layers
        self.calls += 1
        c, bs = self.cfg, self.cfg.block_size
        Hkv = k.shape[1]
        G = q.shape[1] // Hkv
        s32 = token_scores(q, k, lengths, scale)
        s64 = exact_scores(q, k, lengths, scale)
        true_blse = block_lse(s64, bs)  # [B, Hq, NB] float64
        exact = block_metadata(k, lengths, bs)
        kept = as_kept(exact, c)  # 8-bit min/max, as decode reads them
        nblk = num_blocks(lengths, bs)[:, None].float()
        log_count = kept.count.clamp(min=1).log()[:, None, :]
        empty = (kept.count == 0)[:, None, :]

        orders, bounds = {}, {}
        share = (true_blse - torch.logsumexp(true_blse, -1, keepdim=True)).float()
        orders["oracle"] = order_blocks(
            share.view(*share.shape[:1], Hkv, G, -1).amax(2), lengths, c
        )
        bounds["oracle"] = true_blse
        orders["box"] = order_blocks(criticality(q, kept, scale, "bound"), lengths, c)
        box = (bound_logits(q, kept, scale) + log_count).masked_fill(empty, -torch.inf)
        bounds["box"] = box.double()
        for rule, w in self.widths.items():
            b = w if isinstance(w, int) else w[layer]
            codes = encode_keys(k, lengths, kept.kmin, kept.kmax, bs, b)
            ub = token_score_bounds(q, codes, lengths, scale)
            valid = torch.isfinite(s32)
            assert (ub[valid] >= s32[valid]).all(), "a code bound is below a float32 score"
            assert (ub.double()[valid] >= s64[valid]).all(), "a code bound is below a score"
            blse = block_lse(ub.double(), bs)
            orders[rule] = order_blocks(criticality_from_logits(blse.float(), Hkv), lengths, c)
            bounds[rule] = blse
            ratio = torch.logsumexp(blse, -1) - torch.logsumexp(true_blse, -1)
            self.slack[rule].extend(ratio.flatten().tolist())
        ratio = torch.logsumexp(box.double(), -1) - torch.logsumexp(true_blse, -1)
        self.slack["box"].extend(ratio.flatten().tolist())

        for eps in self.eps:
            for rule in self.rules:
                if rule == "box_waves":
                    rc = c.replace(stop_rule="certified", threshold=eps)
                    res = self.original(q, k, v, lengths, rc, meta=exact, scale=scale)
                    readq = res.read.repeat_interleave(G, 1)
                    cov = torch.logsumexp(true_blse.masked_fill(~readq, -torch.inf), -1)
                    cov = (cov - torch.logsumexp(true_blse, -1)).exp()
                    n_read = res.read.sum(-1)
                else:
                    order = orders[rule][0]
                    n_read, cov = certified_stop(order, true_blse, bounds[rule], lengths, c, eps)
                if rule != "oracle":  # the certified guarantee, up to float64 evaluation
                    assert cov.min().item() >= eps - 1e-9, (rule, eps, cov.min().item())
                self.frac[rule, eps][layer].extend((n_read.float() / nblk).flatten().tolist())
                self.cov[rule, eps][layer].append(cov.min().item())
        return self.original(q, k, v, lengths, cfg, meta=meta, scale=scale, **kwargs)


class Calibrate:
    """Per layer and KV head, a channel's typical `|q_i| (kmax_i - kmin_i)` over decode
    calls (mean |q| over the group's heads, times the median over blocks of the kept
    range): the weights `allocate_bits` spends a calibrated width budget by."""

    def __init__(self, n_layers: int):
        self.n_layers, self.calls = n_layers, 0
        self.q: dict[int, list] = defaultdict(list)
        self.r: dict[int, list] = defaultdict(list)
        self.original = hf_attention.progressive_attention

    def __call__(self, q, k, v, lengths, cfg, meta=None, scale=None, **kwargs):
        layer = self.calls % self.n_layers
        self.calls += 1
        Hkv = k.shape[1]
        kept = as_kept(block_metadata(k, lengths, PSAConfig().block_size), PSAConfig())
        self.q[layer].append(q.float().abs().view(q.shape[0], Hkv, -1, q.shape[-1]).mean((0, 2)))
        self.r[layer].append((kept.kmax - kept.kmin)[0].median(1).values)  # [Hkv, d]
        return self.original(q, k, v, lengths, cfg, meta=meta, scale=scale, **kwargs)

    def weights(self) -> list[torch.Tensor]:
        return [
            torch.stack(self.q[i]).mean(0) * torch.stack(self.r[i]).mean(0)
            for i in range(self.n_layers)
        ]


def decode_with(hook, session: Session, steps: int) -> None:
    """`steps` dense decode steps after the session's context, `hook` in PSA's place."""
    hf_attention.progressive_attention = hook
    try:
        session.decode(DecodePolicy("psa", PSAConfig(threshold=1.0)), steps + 1)
    finally:
        hf_attention.progressive_attention = hook.original


def flat_summary(rows: dict, sketch: dict, slack: dict) -> dict:
    """The result's summary, one number a key (the generated docs/results.md lists it):
    per rule and ε (`rows`, key `<rule>@<ε>`) the mean KV fraction (sketch bytes
    included) and the smallest true coverage; per rule the sketch's KV fraction and the
    median log(bounded / true mass) of a head's whole context."""
    out = {}
    for key, row in rows.items():
        rule, eps = key.split("@")
        out[f"kv_fraction_{rule}_eps{eps}"] = row["kv_fraction"]
        out[f"min_true_coverage_{rule}_eps{eps}"] = row["min_true_coverage"]
    out.update({f"sketch_kv_fraction_{r}": v for r, v in sketch.items()})
    out.update({f"log_bound_over_true_mass_{r}": v for r, v in slack.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--context-tokens", type=int, default=16384)
    ap.add_argument("--kinds", default="niah_1key,niah_4key,variable_tracking,doc_qa")
    ap.add_argument("--per-kind", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="decode steps captured per task")
    ap.add_argument("--eps", default="0.8,0.9,0.95")
    ap.add_argument("--bits", default="2,4,5,6", help="code bits per channel")
    ap.add_argument(
        "--alloc-bits",
        default="3,4,5,6",
        help="mean bits a channel of calibrated per-channel widths ('': none)",
    )
    ap.add_argument("--calib-kind", default="common_words", help="task kind calibrated on")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="certified_bound_cpu_16k")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in GENERATORS]
    if unknown:
        ap.error(f"--kinds: unknown {', '.join(unknown)} (choose from {', '.join(GENERATORS)})")
    eps_list = [float(e) for e in args.eps.split(",")]
    bits = [int(b) for b in args.bits.split(",") if b]
    alloc_bits = [int(b) for b in args.alloc_bits.split(",") if b]
    t0 = time.time()
    model, tok = load_model(ensure_model(args.model))
    mc = model.config
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    tasks = make_tasks(kinds, args.context_tokens, args.per_kind, args.seed, count)
    widths: dict[str, int | list] = {f"codes{b}": b for b in bits}
    allocation = {}
    if alloc_bits:
        # Calibrated widths: a task of another kind (and length) than the ones scored.
        calib = make_tasks([args.calib_kind], args.calib_tokens, 1, args.seed, count)[0]
        session = Session(model, tok)
        session.extend(sum(chat_parts(tok, calib.prompt, calib.question), []))
        cal = Calibrate(mc.num_hidden_layers)
        decode_with(cal, session, args.steps)
        weights = cal.weights()
        for b in alloc_bits:
            widths[f"alloc{b}"] = [allocate_bits(w, b) for w in weights]
            allocation[f"alloc{b}"] = [w.tolist() for w in widths[f"alloc{b}"]]
        print(f"[cert] calibrated on {calib.kind}, {time.time() - t0:.0f} s", flush=True)
    cap = Capture(eps_list, widths, mc.num_hidden_layers)
    lengths = []
    for i, task in enumerate(tasks, 1):
        doc, q = chat_parts(tok, task.prompt, task.question)
        session = Session(model, tok)
        session.extend(doc + q)
        lengths.append(session.length)
        print(
            f"[cert] task {i}/{len(tasks)} {task.kind}: {session.length} tokens, "
            f"{time.time() - t0:.0f} s",
            flush=True,
        )
        decode_with(cap, session, args.steps)

    kv_token = 2 * head_dim * KV_ELEM_BYTES
    meta_frac = meta_bytes_per_block(head_dim) / (PSAConfig().block_size * kv_token)
    sketch = {"oracle": 0.0, "box": meta_frac, "box_waves": meta_frac}
    for rule, w in widths.items():
        per_layer_bytes = [
            code_bytes_per_token(x, head_dim) for x in (w if isinstance(w, list) else [w])
        ]
        code_bytes = sum(per_layer_bytes) / len(per_layer_bytes)
        sketch[rule] = meta_frac + code_bytes / kv_token
    rows: dict = {}
    per_layer = {}
    for eps in eps_list:
        for rule in cap.rules:
            fr = [x for _, v in sorted(cap.frac[rule, eps].items()) for x in v]
            blocks = sum(fr) / len(fr)
            key = f"{rule}@{eps}"
            rows[key] = {
                "kv_fraction": blocks + sketch[rule],
                "blocks_fraction": blocks,
                "max_blocks_fraction": max(fr),
                "min_true_coverage": min(x for v in cap.cov[rule, eps].values() for x in v),
            }
            per_layer[key] = {
                "blocks_fraction": [
                    sum(v) / len(v) for _, v in sorted(cap.frac[rule, eps].items())
                ],
                "min_true_coverage": [min(v) for _, v in sorted(cap.cov[rule, eps].items())],
            }
    slack = {}
    for r, v in cap.slack.items():
        t = torch.tensor(v)
        slack[r] = {"median": t.median().item(), "max": t.max().item()}
    summary = flat_summary(rows, sketch, {r: s["median"] for r, s in slack.items()})
    summary["n_tasks"] = len(tasks)
    summary["steps_per_task"] = args.steps
    summary["layers"] = mc.num_hidden_layers
    summary["wall_s"] = round(time.time() - t0)
    write_result(
        RESULTS / f"{args.name}.json",
        summary,
        {
            "rows": rows,
            "per_layer": per_layer,
            "log_bound_over_true_mass": slack,
            "lengths": lengths,
            "allocated_bits": allocation,
        },
        model=MODELS[args.model].name,
        context_tokens=args.context_tokens,
        kinds=kinds,
        eps=eps_list,
        bits=bits,
        alloc_bits=alloc_bits,
        calibration=f"{args.calib_kind} at {args.calib_tokens} tokens" if alloc_bits else None,
        steps=args.steps,
        stop_granularity="one block at a time (box_waves: the library's waves)",
    )
    for key, row in rows.items():
        print(key, row)


if __name__ == "__main__":
    main()
