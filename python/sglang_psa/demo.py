"""CPU demo: a real model answers questions about a long document with dense and PSA decode.

    python -m sglang_psa.demo [--context-tokens 8192] [--thresholds 0.95,0.98]

(With a GPU and SGLang installed this runs the server demo, `sglang_psa.serve_demo`,
instead; `--cpu` forces the CPU demo.)

The document (seeded filler with facts hidden at random depths) is prefilled
once with dense attention; each question is then decoded greedily with dense
attention and with progressive sparse attention at each ε. Printed: each
answer, whether it is correct and identical to dense, and per layer the
fraction of KV blocks PSA read (mean and p99 over decode steps and KV heads).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import torch

from sglang_psa.config import STOP_RULES, PSAConfig
from sglang_psa.eval.runner import chat_parts, layer_summary
from sglang_psa.eval.tasks import demo_document
from sglang_psa.hf.attention import DecodePolicy
from sglang_psa.hf.decode import Session, load_model
from sglang_psa.models import DEFAULT_MODEL, MODELS, ensure_model


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--cpu" not in argv and torch.cuda.is_available() and importlib.util.find_spec("sglang"):
        from sglang_psa import serve_demo  # a GPU and SGLang: the server is the main job

        return serve_demo.main(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="this demo (transformers on the CPU) even where a GPU and SGLang would run the "
        "server demo",
    )
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS), help="%(default)s")
    ap.add_argument(
        "--context-tokens", type=int, default=8192, help="document length (%(default)s)"
    )
    ap.add_argument(
        "--thresholds", default="0.95,0.98", help="comma-separated PSA ε values (%(default)s)"
    )
    ap.add_argument(
        "--stop-rule", default="heuristic", choices=STOP_RULES, help="PSA's (%(default)s)"
    )
    ap.add_argument(
        "--questions",
        type=int,
        default=4,
        choices=range(1, 5),
        metavar="{1..4}",
        help="how many of the 4 hidden facts to ask about",
    )
    ap.add_argument("--seed", type=int, default=1, help="of the document and its facts")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="weights and KV: auto is float32 on the CPU (most CPUs multiply bfloat16 several "
        "times slower: 7x on an AVX2 host) and bfloat16 on a GPU (%(default)s)",
    )
    args = ap.parse_args(argv)
    spec = MODELS[args.model]
    if not 256 <= args.context_tokens <= spec.max_context - 256:
        ap.error(f"--context-tokens must be in [256, {spec.max_context - 256}] for {args.model}")
    try:
        eps = [float(x) for x in args.thresholds.split(",")]
        policies = [DecodePolicy("dense")] + [
            DecodePolicy("psa", PSAConfig(threshold=e, stop_rule=args.stop_rule)) for e in eps
        ]
    except ValueError as e:
        ap.error(f"--thresholds: {e}")
    names = {p.label: short_name(p) for p in policies}

    t0 = time.time()
    print(f"[1/3] model {spec.name}", flush=True)
    dtype = (
        args.dtype if args.dtype != "auto" else "float32" if args.device == "cpu" else "bfloat16"
    )
    model, tok = load_model(ensure_model(args.model), getattr(torch, dtype), device=args.device)
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])
    doc, questions = demo_document(count, args.context_tokens, args.seed)
    doc_ids, _ = chat_parts(tok, doc, "")
    print(f"[2/3] prefill of a {len(doc_ids)}-token document (dense) ...", flush=True)
    session = Session(model, tok)
    session.extend(
        doc_ids,
        chunk=1024,
        progress=lambda done, total: print(
            f"      {done}/{total} tokens, {time.time() - t0:.0f}s", flush=True
        ),
    )
    doc_len = session.length
    print(f"      done in {time.time() - t0:.0f}s", flush=True)
    stop = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}

    questions = questions[: args.questions]
    rows, fractions = [], {p.label: {} for p in policies[1:]}
    print(f"[3/3] {len(questions)} questions x {len(policies)} decode policies", flush=True)
    for i, task in enumerate(questions, 1):
        _, q_ids = chat_parts(tok, doc, task.question)
        session.extend(q_ids)
        dense = None
        for p in policies:
            d = session.decode(p, task.max_new_tokens, stop)
            dense = d if dense is None else dense
            rows.append(
                (
                    i,
                    task.question.split("?")[0] + "?",
                    p.label,
                    d.text.strip(),
                    task.score(d.text),
                    d.tokens == dense.tokens,
                    d.kv_fraction(),
                )
            )
            for layer, f in d.layer_fractions.items():
                if p.kind != "dense":
                    fractions[p.label].setdefault(layer, []).append(f)
            print(f"      q{i} {names[p.label]:9s} -> {d.text.strip()[:40]!r}", flush=True)
        session.rewind(doc_len)

    print(f"\nAnswers ({doc_len}-token document, {args.model}, {args.device})")
    print(legend(policies))
    print(f"{'#':>2} {'policy':9s} {'answer':24s} {'correct':>7s} {'=dense':>6s} {'KV read':>8s}")
    for i, _, label, ans, ok, same, frac in rows:
        print(
            f"{i:>2} {names[label]:9s} {ans[:24]:24s} {'yes' if ok else 'NO':>7s} "
            f"{'yes' if same else 'no':>6s} {frac:8.1%}"
        )
    labels = list(fractions)
    summ = {
        lab: layer_summary({k: torch.cat(v) for k, v in fractions[lab].items()}) for lab in labels
    }
    caps = {p.label: read_cap_of(p) for p in policies[1:]}
    print("\nFraction of KV blocks read per layer (mean / p99 over steps and KV heads)")
    print(f"{'layer':>5} " + " ".join(f"{names[lab]:>17s}" for lab in labels))
    n_layers = len(next(iter(summ.values()))[0]) if summ else 0
    at_cap = 0
    for layer in range(n_layers):
        cells = []
        for lab in labels:
            mean, p99 = summ[lab][0][layer], summ[lab][1][layer]
            mark = "*" if caps[lab] is not None and p99 >= caps[lab] - 1e-6 else " "
            at_cap += mark == "*"
            cells.append(f"{mean:6.1%} / {p99:6.1%}{mark}")
        print(f"{layer:>5} " + " ".join(f"{c:>17s}" for c in cells))
    if at_cap:
        cap = next(c for c in caps.values() if c is not None)
        print(
            f"  * p99 at the read cap: 1% or more of that layer's (step, KV head) reads stopped "
            f"at {cap:.0%} of the blocks (--psa-max-read-fraction) before the stop rule held"
        )
    print()
    for p in policies:
        sel = [r for r in rows if r[2] == p.label]
        print(
            f"{names[p.label]:9s} {sum(r[4] for r in sel)}/{len(sel)} correct, "
            f"{sum(r[5] for r in sel)}/{len(sel)} identical to dense, "
            f"mean KV read {sum(r[6] for r in sel) / len(sel):.1%}"
        )
    print(f"total {time.time() - t0:.0f}s")
    return 0


def short_name(p: DecodePolicy) -> str:
    """`dense`, or `psa-<ε>` (`legend` gives the policy's full label once)."""
    return "dense" if p.kind == "dense" else f"psa-{p.cfg.threshold:g}"


def read_cap_of(p: DecodePolicy) -> float | None:
    """The most blocks a KV head reads (a fraction), where the cap applies to `p`."""
    capped = p.kind == "psa" and p.cfg.stop_rule == "heuristic" and p.cfg.threshold < 1
    return p.cfg.max_read_fraction if capped and p.cfg.max_read_fraction < 1 else None


def legend(policies: list[DecodePolicy]) -> str:
    """What each short name stands for, and the settings the PSA policies share."""
    lines = ["  dense     reads every KV block"]
    for p in policies:
        if p.kind == "psa":
            lines.append(
                f"  {short_name(p):9s} PSA: stops once {p.cfg.threshold:g} of the softmax mass "
                f"is covered ({p.label})"
            )
    psa = next((p.cfg for p in policies if p.kind == "psa"), None)
    if psa is not None:
        parts = [f"{psa.stop_rule} stop rule"]
        if psa.bound_bits == 8:
            parts.append("8-bit key bounds (q8)")
        if psa.wave_fraction:
            parts.append(
                f"first wave 1/{1 / psa.wave_fraction:g} of the blocks (wf{1 / psa.wave_fraction:g}),"
                f" at most {psa.max_first_wave_blocks} (fw{psa.max_first_wave_blocks})"
            )
        if psa.stop_rule == "heuristic" and psa.max_read_fraction < 1:
            parts.append(
                f"a KV head reads at most {psa.max_read_fraction:g} of the blocks "
                f"(mr{psa.max_read_fraction:g}, the read cap)"
            )
        lines.append("  PSA settings (the server's defaults): " + "; ".join(parts))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
