"""Record which KV blocks PSA reads, per decode step, on the real test model.

    python benchmark/store/record_traces.py            # qwen2.5-0.5b, 8K tokens, 32 steps

For each generated task (one per kind), prefill the document and question
densely, then decode greedily for exactly `--steps` steps with PSA at the
default config (ε = 0.98, heuristic stop rule), recording the read mask of every
layer through `runtime().trace`. Decoding ignores end-of-sequence so that every
trace has the same length (the step at which the model would have stopped is
kept in the metadata). One compressed `.npz` per run, under
`$SGLANG_PSA_CACHE/traces/` (not committed):

- `read_<i>`: bool `[steps, layers, H_kv, n_blocks]` for task i (padded with
  False past a step's blocks);
- `n_blocks_<i>`: int `[steps]`, blocks holding tokens at that step (the last
  one is the tail block);
- `meta`: JSON string (model, context, steps, seed, config, per-task kind,
  context tokens, output, stop step, recording time).

`benchmark/store/slot_hit_rate.py` replays these traces through the slot cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from sglang_psa.config import PSAConfig
from sglang_psa.eval.runner import _extra_stops, chat_parts
from sglang_psa.eval.tasks import make_tasks
from sglang_psa.hf.attention import BlockTrace, DecodePolicy, runtime
from sglang_psa.hf.decode import Session, load_model
from sglang_psa.models import DEFAULT_MODEL, MODELS, cache_dir, ensure_model


def trace_path(model: str, context_tokens: int, steps: int, seed: int) -> Path:
    """Where a run with these settings is stored."""
    return cache_dir() / "traces" / f"{model}-ctx{context_tokens}-steps{steps}-seed{seed}.npz"


def stack_trace(trace: list[BlockTrace], n_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """`(read [steps, layers, H_kv, NB] bool, n_blocks [steps])` for a batch of one request.

    `trace` must hold whole steps, layers in order 0..n_layers-1 within each step.
    """
    if len(trace) % n_layers:
        raise ValueError(f"{len(trace)} trace entries are not whole steps of {n_layers} layers")
    steps = len(trace) // n_layers
    nb = max(int(t.n_blocks.max()) for t in trace)
    h = trace[0].read.shape[1]
    read = np.zeros((steps, n_layers, h, nb), dtype=bool)
    n_blocks = np.zeros(steps, dtype=np.int64)
    for i, t in enumerate(trace):
        s, layer = divmod(i, n_layers)
        if t.layer != layer or t.read.shape[0] != 1:
            raise ValueError(f"entry {i}: layer {t.layer} (want {layer}), batch {t.read.shape[0]}")
        n = int(t.n_blocks[0])
        read[s, layer, :, :n] = t.read[0, :, :n].numpy()
        if layer and n != n_blocks[s]:
            raise ValueError(f"step {s}: layers disagree on the block count")
        n_blocks[s] = n
    return read, n_blocks


@torch.inference_mode()
def decode_traced(
    session: Session, policy: DecodePolicy, steps: int, bar=None
) -> tuple[list[int], list[BlockTrace]]:
    """Greedy tokens (`steps + 1`: the first from the prefill logits) and the trace of the
    `steps` decode steps. End-of-sequence does not stop it: every trace has `steps` steps."""
    rt = runtime()
    rt.reset()
    rt.trace = trace = []
    tokens = [int(session.next_logits.argmax())]
    try:
        with rt.use(policy):
            for _ in range(steps):
                out = session.model(
                    input_ids=torch.tensor([[tokens[-1]]], device=session.model.device),
                    past_key_values=session.cache,
                    use_cache=True,
                )
                session.length += 1
                tokens.append(int(out.logits[0, -1].argmax()))
                if bar is not None:
                    bar.update(1)
    finally:
        rt.trace = None
        rt.reset()
    return tokens, trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--context-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=32, help="decode steps recorded per task")
    ap.add_argument("--kinds", default="niah_4key,variable_tracking,doc_qa")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threshold", type=float, default=PSAConfig().threshold)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None, help="default: cache/traces/<run>.npz")
    args = ap.parse_args()
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    model, tok = load_model(ensure_model(args.model), device=args.device)
    n_layers = model.config.num_hidden_layers
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])
    tasks = make_tasks(args.kinds.split(","), args.context_tokens, 1, args.seed, count)
    cfg = PSAConfig(threshold=args.threshold)
    policy = DecodePolicy("psa", cfg)
    stops = {tok.eos_token_id} | set(_extra_stops(tok))
    arrays: dict[str, np.ndarray] = {}
    runs = []
    bar = tqdm(total=len(tasks) * (args.steps + 1), desc="record", unit="step", dynamic_ncols=True)
    for i, task in enumerate(tasks):
        doc_ids, q_ids = chat_parts(tok, task.prompt, task.question)
        bar.set_postfix_str(f"prefill {task.kind} ({len(doc_ids) + len(q_ids)} tok)")
        session = Session(model, tok)
        session.extend(doc_ids + q_ids)
        bar.update(1)
        bar.set_postfix_str(f"decode {task.kind}")
        tokens, trace = decode_traced(session, policy, args.steps, bar)
        read, n_blocks = stack_trace(trace, n_layers)
        arrays[f"read_{i}"], arrays[f"n_blocks_{i}"] = read, n_blocks
        stop_at = next((j for j, t in enumerate(tokens) if t in stops), None)
        text = tok.decode(tokens[:stop_at], skip_special_tokens=True)
        runs.append(
            {
                "kind": task.kind,
                "context_tokens": len(doc_ids) + len(q_ids),
                "n_blocks": [int(n_blocks[0]), int(n_blocks[-1])],
                "fraction_read": float(read.sum() / (n_blocks.sum() * n_layers * read.shape[2])),
                "output": text,
                "correct": task.score(text),
                "stop_step": stop_at,
            }
        )
    bar.close()
    meta = {
        "model": args.model,
        "model_name": MODELS[args.model].name,
        "context_tokens": args.context_tokens,
        "steps": args.steps,
        "seed": args.seed,
        "kinds": args.kinds.split(","),
        "policy": policy.label,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "extra"},
        "n_layers": n_layers,
        "n_kv_heads": int(read.shape[2]),
        "device": args.device,
        "seconds": round(time.perf_counter() - t0, 1),
        "tasks": runs,
    }
    out = args.out or trace_path(args.model, args.context_tokens, args.steps, args.seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, meta=np.array(json.dumps(meta)), **arrays)
    for r in runs:
        print(
            f"{r['kind']:18s} {r['context_tokens']:6d} tok  read {r['fraction_read']:.3f}  "
            f"correct {r['correct']}  stop at {r['stop_step']}  {r['output']!r}"
        )
    print(f"recorded in {meta['seconds']} s -> {out}")


if __name__ == "__main__":
    main()
