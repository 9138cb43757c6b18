"""`python -m sglang.bench_serving`, unchanged except that the custom dataset's prompts
go to the server as token ids (`input_ids`) instead of text.

    python benchmark/serving/client_ids.py <bench_serving arguments>

Why: SGLang's tokenizer manager tokenizes a text prompt inside its event loop. When
32 prompts of 16-28K tokens arrive in one instant (the a/a16 workloads), it can
tokenize all of them (~50 ms per 28K-token prompt) before it hands any first token
back, so the prompts prefilled meanwhile all report their first token at one shared
moment, and that moment moves from run to run with how the requests' arrivals
batch. Sent as ids, TTFT measures the server's prefill and queueing, the same for
every system. The ids are exactly what the server's own tokenization of the text
gives (`tokenizer.encode`, as `bench_serving` counts prompt lengths), so the answers
do not change.

Contract: the rows keep their `prompt_len`; a prompt whose ids do not count
`prompt_len` tokens stops the client. Relies on SGLang 0.5.17's
`sglang.benchmark.datasets.custom.CustomDataset.load` (checked: a clear error
names it when it moved).
"""

from __future__ import annotations


def to_ids(rows: list, tokenizer) -> list:
    """Each row's text prompt replaced by its token ids, in place; returns the rows."""
    for row in rows:
        if not isinstance(row.prompt, str):
            raise SystemExit(f"client_ids: a prompt of type {type(row.prompt).__name__}")
        ids = tokenizer.encode(row.prompt)
        if len(ids) != row.prompt_len:
            raise SystemExit(
                f"client_ids: a prompt counts {len(ids)} tokens, bench_serving counted "
                f"{row.prompt_len}"
            )
        row.prompt = ids
    return rows


def patch() -> None:
    """Make bench_serving's custom dataset load its prompts as token ids."""
    try:
        from sglang.benchmark.datasets import custom
    except ImportError as e:
        raise SystemExit(
            f"client_ids: sglang.benchmark.datasets.custom is gone ({e}); this SGLang's "
            "bench_serving keeps its custom dataset elsewhere"
        ) from None
    load = getattr(getattr(custom, "CustomDataset", None), "load", None)
    if load is None:
        raise SystemExit("client_ids: sglang.benchmark.datasets.custom.CustomDataset.load is gone")

    def load_ids(self, tokenizer, model_id=None):
        return to_ids(load(self, tokenizer, model_id), tokenizer)

    custom.CustomDataset.load = load_ids


if __name__ == "__main__":
    patch()
    from sglang.benchmark.serving import cli_main

    cli_main()
