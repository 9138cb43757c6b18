"""Compare decode policies on long-context tasks: one dense prefill, many decodes.

Used by the CPU demo (`python -m sglang_psa.demo`) and the accuracy benchmark
(`benchmark/accuracy/run.py`). The first policy must be dense: every other
policy is also scored for agreement with it (identical greedy tokens).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from sglang_psa.eval.tasks import Task, chat_text
from sglang_psa.hf.attention import DecodePolicy
from sglang_psa.hf.decode import Session, mean_kl

QUESTION_MARK = "\x00QUESTION\x00"


def chat_parts(tok, document: str, question: str) -> tuple[list[int], list[int]]:
    """Token ids of (chat prefix + document) and (question + assistant prefix).

    Split so that several questions can follow one prefilled document.
    """
    head, tail = chat_text(tok, document, QUESTION_MARK).split(QUESTION_MARK)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    return enc(head), enc(question + tail)


@dataclass
class Outcome:
    task: str
    context_tokens: int
    policy: str
    correct: bool
    agrees_with_dense: bool
    kv_fraction: float  # mean over layers, steps and KV heads
    # mean next-token KL divergence from dense along dense's greedy tokens (teacher forced;
    # `evaluate(kl=True)` only, else None)
    kl_from_dense: float | None
    layer_mean: list[float]
    layer_p99: list[float]
    output: str

    def to_json(self) -> dict:
        return asdict(self)


def layer_summary(fractions: dict[int, torch.Tensor]) -> tuple[list[float], list[float]]:
    means, p99s = [], []
    for _, f in sorted(fractions.items()):
        means.append(float(f.mean()) if f.numel() else float("nan"))
        p99s.append(float(torch.quantile(f, 0.99)) if f.numel() else float("nan"))
    return means, p99s


def policy_summary(rows: list[Outcome]) -> dict[str, float]:
    """Accuracy, agreement with dense, KV fraction read and (when measured) the KL from
    dense, averaged over one policy's runs."""
    n = len(rows)
    kls = [o.kl_from_dense for o in rows if o.kl_from_dense is not None]
    return {
        "accuracy": sum(o.correct for o in rows) / n,
        "agreement_with_dense": sum(o.agrees_with_dense for o in rows) / n,
        "kv_fraction": sum(o.kv_fraction for o in rows) / n,
        "mean_kl": sum(kls) / len(kls) if kls else None,
    }


def evaluate(
    model,
    tok,
    tasks: list[Task],
    policies: list[DecodePolicy],
    progress: bool = True,
    kl: bool = False,
) -> list[Outcome]:
    """Run every task under every policy; returns one `Outcome` per (task, policy). With
    `kl`, each policy is also run teacher forced along dense's greedy tokens and scored by
    its mean next-token KL divergence from dense (one more decode pass per policy)."""
    from tqdm.auto import tqdm

    if not policies or policies[0].kind != "dense":
        raise ValueError("the first policy must be dense (the reference for agreement)")
    stop = stop_ids(tok)
    outcomes: list[Outcome] = []
    bar = tqdm(
        total=len(tasks) * len(policies),
        disable=not progress,
        desc="decode",
        unit="run",
        dynamic_ncols=True,
    )
    for task in tasks:
        doc_ids, q_ids = chat_parts(tok, task.prompt, task.question)
        session = Session(model, tok)
        bar.set_postfix_str(f"prefill {task.kind} ({len(doc_ids) + len(q_ids)} tok)")
        session.extend(doc_ids + q_ids)
        dense_tokens = dense_lp = None
        for policy in policies:
            bar.set_postfix_str(f"{task.kind} {policy.label}")
            dec = session.decode(policy, task.max_new_tokens, stop)
            dense_tokens = dec.tokens if dense_tokens is None else dense_tokens
            divergence = None
            if kl:
                lp = session.forced_logprobs(policy, dense_tokens)
                dense_lp = lp if dense_lp is None else dense_lp
                divergence = mean_kl(dense_lp, lp)
            means, p99s = layer_summary(dec.layer_fractions)
            outcomes.append(
                Outcome(
                    task=task.kind,
                    context_tokens=session.length,
                    policy=policy.label,
                    correct=task.score(dec.text),
                    agrees_with_dense=dec.tokens == dense_tokens,
                    kv_fraction=dec.kv_fraction(),
                    kl_from_dense=divergence,
                    layer_mean=means,
                    layer_p99=p99s,
                    output=dec.text,
                )
            )
            bar.update(1)
    bar.close()
    return outcomes


def stop_ids(tok) -> set[int]:
    """Token ids that end a completion: EOS and the chat templates' end-of-turn tokens
    this tokenizer has."""
    ids = {tok.eos_token_id}
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tok.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tok.unk_token_id:
            ids.add(tid)
    return ids
