"""Greedy agreement between two SGLang engines on the same prompts.

Two correct attention kernels round differently in bf16, so greedy decoding can
legitimately part ways where the leading tokens are nearly tied. A divergence
counts as explained only when the token the other engine chose is among the
reference engine's top `TOP` there, less than `tie` below the reference's choice
(a three-way tie in bf16 makes the third token as legitimate as the second).
A split at an exact tie (the reference gave both tokens the same log-prob) is where
greedy decoding itself is undefined: which token wins depends only on the order in
which an argmax meets equal values, not on the model, so `fraction_agreeing` counts it
with the identical completions.
"""

from __future__ import annotations

# bf16 logits of magnitude 16-32 are spaced 0.125 apart: a gap of two such steps is
# within what a different but correct kernel can flip.
DEFAULT_TIE = 0.25
TOP = 5  # candidates recorded per step


def greedy(eng, prompts: list, max_new: int) -> list[dict]:
    """Greedy completions with each step's chosen id and the top `TOP` (logprob, id)."""
    key = "input_ids" if isinstance(prompts[0], list) else "prompt"
    outs = eng.generate(
        **{key: prompts},
        sampling_params={"temperature": 0, "max_new_tokens": max_new},
        return_logprob=True,
        top_logprobs_num=TOP,
    )
    return [
        {
            "ids": [t[1] for t in o["meta_info"]["output_token_logprobs"]],
            "top": [[(x[0], x[1]) for x in step] for step in o["meta_info"]["output_top_logprobs"]],
            "text": o["text"],
        }
        for o in outs
    ]


def compare(ref: list[dict], other: list[dict], tie: float = DEFAULT_TIE) -> dict:
    """How many completions are identical; where not, whether each split is a near-tie."""
    if len(ref) != len(other):
        raise ValueError(f"{len(ref)} reference completions but {len(other)} to compare")
    same, splits, lp_diff = 0, [], []
    for n, (a, b) in enumerate(zip(ref, other)):
        # The first decode step (after prefill) is where the two decode kernels first meet.
        if len(a["top"]) > 1 and len(b["top"]) > 1:
            lp_diff.append(abs(a["top"][1][0][0] - b["top"][1][0][0]))
        if a["ids"] == b["ids"]:
            same += 1
            continue
        i = next((j for j, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y), None)
        if i is None:  # one stopped earlier (EOS) with the same prefix
            i = min(len(a["ids"]), len(b["ids"]))
        top = a["top"][i] if i < len(a["top"]) else []
        chosen = b["ids"][i] if i < len(b["ids"]) else None
        lp = {t: v for v, t in top}
        own = a["ids"][i] if i < len(a["ids"]) else None
        # How far below the reference's own token the other engine's token lay there (an
        # exact tie may list either first); infinite when it is not in the reference's top
        # list (a result file holds null: `dump_result`).
        gap = lp[own] - lp[chosen] if own in lp and chosen in lp else float("inf")
        splits.append(
            {
                "prompt": n,
                "step": i,
                "chosen_rank": next((r for r, (_, t) in enumerate(top) if t == chosen), None),
                "gap": gap,
                "near_tie": gap < tie,
                "exact_tie": gap == 0.0,
            }
        )
    total = len(ref)
    exact = sum(s["exact_tie"] for s in splits)
    return {
        "n": total,
        "identical": same,
        "fraction_identical": same / total if total else 1.0,
        "divergences": splits,
        "divergences_at_near_tie": sum(s["near_tie"] for s in splits),
        "divergences_at_exact_tie": exact,
        # identical, or parted first where greedy decoding is undefined (an exact tie)
        "fraction_agreeing": (same + exact) / total if total else 1.0,
        "max_second_step_logprob_diff": max(lp_diff) if lp_diff else None,
        "tie": tie,
    }
