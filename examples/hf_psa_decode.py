"""Greedy decoding of one prompt with PSA decode attention inside a transformers model.

    python examples/hf_psa_decode.py --threshold 0.95 "Your prompt here"

Prefill is dense; every decode step attends KV blocks in criticality order
until ε of the softmax mass is covered. Prints the answer and the fraction of
KV blocks read.
"""

from __future__ import annotations

import argparse

from sglang_psa.config import PSAConfig
from sglang_psa.hf import DecodePolicy, greedy_decode
from sglang_psa.hf.decode import load_model
from sglang_psa.models import DEFAULT_MODEL, MODELS, ensure_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompt")
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--threshold", type=float, default=0.98)
    ap.add_argument("--stop-rule", default="heuristic", choices=["heuristic", "certified"])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    model, tok = load_model(ensure_model(args.model))
    policy = DecodePolicy("psa", PSAConfig(threshold=args.threshold, stop_rule=args.stop_rule))
    out = greedy_decode(model, tok, args.prompt, policy, args.max_new_tokens)
    print(out.text)
    print(f"KV blocks read: {out.kv_fraction():.1%}")


if __name__ == "__main__":
    main()
