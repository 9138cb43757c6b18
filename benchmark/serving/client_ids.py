"""`python -m sglang.bench_serving`, unchanged except that the custom dataset's prompts
go to the server as token ids (`input_ids`) instead of text, and that its output line
also says when the last request went out; and, with `--worker`, one client process for
many runs.

    python benchmark/serving/client_ids.py <bench_serving arguments>
    python benchmark/serving/client_ids.py --worker     (driven by driver.Client)

Why ids: SGLang's tokenizer manager tokenizes a text prompt inside its event loop. When
32 prompts of 16-28K tokens arrive in one instant (the a/a16 workloads), it can
tokenize all of them (~50 ms per 28K-token prompt) before it hands any first token
back, so the prompts prefilled meanwhile all report their first token at one shared
moment, and that moment moves from run to run with how the requests' arrivals
batch. Sent as ids, TTFT measures the server's prefill and queueing, the same for
every system. The ids are exactly what the server's own tokenization of the text
gives (`tokenizer.encode`, as `bench_serving` counts prompt lengths), so the answers
do not change.

Why a worker: each run used to start a client: import SGLang's benchmark, load the
tokenizer, tokenize the 32 prompts twice (10 s on the CPU machine for a16: 7.2 s, 1.7
s and 1.2 s; on the GPU host no decode step had begun 20 s after a client's launch for
a run whose serving took ~5 s). The worker imports once, keeps each tokenizer and each
prompt's ids (a later run of the same prompts starts in ~0 s), and runs
`bench_serving`'s own command line once per request it reads.

Worker protocol: one JSON object a line on stdin, `{"argv": [bench_serving
arguments], "log": path, "prompt_format": "ids" | "text"}`; the run's output goes to
`log` (the process's stdout and stderr point there during the run, to the stderr the
worker started with otherwise: its own log), and one line `{"rc": exit code}` goes back
on the stdout the worker started with, after one `{"ready": true}` once its imports are
done. EOF on stdin ends it.

Why the last send: at a finite rate no server ends a run before its last request has
arrived, so the output tokens over that moment (`idle_duration`: seconds from the first
request's send to the last's, added to the output line) bound every server's output
throughput (`analysis.run_metrics`' `output_tok_s_ceiling`), as a chat's think times do.

Contract: the rows keep their `prompt_len`; a prompt whose ids do not count
`prompt_len` tokens stops the run. Relies on SGLang's (0.5.17 and 0.5.23)
`sglang.benchmark.datasets.custom.CustomDataset.load` and
`sglang.benchmark.serving.cli_main` / `get_tokenizer` / `get_request` (the async
generator that paces the requests; checked: a clear error names what moved).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

SEND_IDS = True  # the worker sets it per run from the request's prompt_format
_SENT: list[float] = []  # a run's sends: seconds from its first request's
_ENCODED: dict[str, list[int]] = {}  # prompt text -> its ids, kept across a worker's runs


class _Memo:
    """A tokenizer whose plain `encode(text)` answers from `_ENCODED` (every other use
    goes to the tokenizer itself)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text, *args, **kwargs):
        if args or kwargs or not isinstance(text, str):
            return self._tok.encode(text, *args, **kwargs)
        ids = _ENCODED.get(text)
        if ids is None:
            ids = _ENCODED[text] = self._tok.encode(text)
        return list(ids)


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


def patch(memo: bool = False) -> None:
    """Make bench_serving's custom dataset load its prompts as token ids (while
    `SEND_IDS`); with `memo`, each prompt tokenized once per process."""
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
        tok = _Memo(tokenizer) if memo else tokenizer
        rows = load(self, tok, model_id)
        return to_ids(rows, tok) if SEND_IDS else rows

    custom.CustomDataset.load = load_ids


def _bench_serving():
    """SGLang's benchmark module, its tokenizer loader made to load each tokenizer once
    and its request generator to note each send (`record_sends`)."""
    import functools

    from sglang.benchmark import serving

    for name in ("cli_main", "get_tokenizer", "get_request"):
        if not callable(getattr(serving, name, None)):
            raise SystemExit(f"client_ids: sglang.benchmark.serving.{name} is gone")
    serving.get_tokenizer = functools.cache(serving.get_tokenizer)
    record_sends(serving)
    return serving


def record_sends(serving) -> None:
    """`serving.get_request` (the async generator that hands bench_serving each request
    when it is due) notes in `_SENT` when it hands each over, from the first."""
    original = serving.get_request

    async def get_request(*args, **kwargs):
        t0 = None
        async for row in original(*args, **kwargs):
            now = time.perf_counter()
            t0 = now if t0 is None else t0
            _SENT.append(now - t0)
            yield row

    serving.get_request = get_request


def note_sends(argv: list[str]) -> None:
    """The output line `argv`'s run wrote (its `--output-file`, the last line) gains
    `idle_duration`: seconds from the run's first send to its last (`_SENT`); none at an
    infinite `--request-rate`, where every request goes at once and nothing is bound."""
    rate = argv[argv.index("--request-rate") + 1] if "--request-rate" in argv else "inf"
    if "--output-file" not in argv or not _SENT or float(rate) == float("inf"):
        return
    path = argv[argv.index("--output-file") + 1]
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.read().splitlines()
    if not lines:
        return
    lines[-1] = json.dumps(json.loads(lines[-1]) | {"idle_duration": _SENT[-1]})
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _run(serving, argv: list[str]) -> int:
    """bench_serving's command line once, in this process; its exit code."""
    sys.argv = ["bench_serving", *argv]
    _SENT.clear()
    try:
        serving.cli_main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:
        traceback.print_exc()
        return 1
    else:
        code = 0
    if code == 0:
        note_sends(argv)
    return code


def serve() -> None:
    """The worker loop (see the module docstring's protocol)."""
    global SEND_IDS
    control = os.fdopen(os.dup(1), "w")
    requests_in = sys.stdin
    own_log = os.dup(2)  # the worker's own output between runs
    os.dup2(own_log, 1)
    patch(memo=True)
    serving = _bench_serving()
    control.write(json.dumps({"ready": True}) + "\n")
    control.flush()
    while line := requests_in.readline():
        if not line.strip():
            continue
        req = json.loads(line)
        SEND_IDS = req.get("prompt_format", "ids") == "ids"
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        try:
            rc = _run(serving, req["argv"])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(own_log, 1)
            os.dup2(own_log, 2)
        control.write(json.dumps({"rc": rc}) + "\n")
        control.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        serve()
    else:
        patch()
        sys.exit(_run(_bench_serving(), sys.argv[1:]))
