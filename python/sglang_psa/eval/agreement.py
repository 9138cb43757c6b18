"""Greedy agreement between two SGLang engines on the same prompts.

Two correct attention kernels round differently in bf16, so greedy decoding can
legitimately part ways where the top two tokens are nearly tied. A divergence
counts as explained only when the token the other engine chose was the reference
engine's second choice and the reference's top-2 gap there is below `tie`.
"""

from __future__ import annotations

# bf16 logits of magnitude 16-32 are spaced 0.125 apart: a gap of two such steps is
# within what a different but correct kernel can flip.
DEFAULT_TIE = 0.25


def greedy(eng, prompts: list, max_new: int) -> list[dict]:
    """Greedy completions with each step's chosen id and the top-2 (logprob, id)."""
    key = "input_ids" if isinstance(prompts[0], list) else "prompt"
    outs = eng.generate(
        **{key: prompts},
        sampling_params={"temperature": 0, "max_new_tokens": max_new},
        return_logprob=True,
        top_logprobs_num=2,
    )
    return [
        {
            "ids": [t[1] for t in o["meta_info"]["output_token_logprobs"]],
            "top2": [
                [(x[0], x[1]) for x in step[:2]] for step in o["meta_info"]["output_top_logprobs"]
            ],
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
        if len(a["top2"]) > 1 and len(b["top2"]) > 1:
            lp_diff.append(abs(a["top2"][1][0][0] - b["top2"][1][0][0]))
        if a["ids"] == b["ids"]:
            same += 1
            continue
        i = next((j for j, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y), None)
        if i is None:  # one stopped earlier (EOS) with the same prefix
            i = min(len(a["ids"]), len(b["ids"]))
        top = a["top2"][i] if i < len(a["top2"]) else []
        gap = top[0][0] - top[1][0] if len(top) > 1 else float("inf")
        second = top[1][1] if len(top) > 1 else None
        chosen = b["ids"][i] if i < len(b["ids"]) else None
        splits.append(
            {
                "prompt": n,
                "step": i,
                "top2_gap": gap,
                "chose_second": chosen == second,
                "near_tie": chosen == second and gap < tie,
            }
        )
    total = len(ref)
    return {
        "n": total,
        "identical": same,
        "fraction_identical": same / total if total else 1.0,
        "divergences": splits,
        "divergences_at_near_tie": sum(s["near_tie"] for s in splits),
        "max_second_step_logprob_diff": max(lp_diff) if lp_diff else None,
        "tie": tie,
    }
