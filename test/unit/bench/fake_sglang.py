"""A stand-in for `python -m sglang.launch_server` and a word-level tokenizer, so that the
serving benchmark's whole path (launch, health, warm-up, SGLang's real `bench_serving`
client, log parsing, scoring, merging) runs on a CPU machine.

    python fake_sglang.py --model-path DIR --port P [any launch_server flags]

The fake answers `/generate` (streamed like SGLang: cumulative text, `completion_tokens`,
`cached_tokens`: the words the prompt shares from its start with an earlier prompt or
prompt and answer since the last flush, as a radix cache without eviction would),
`/health`, `/get_server_info` and `/server_info`, `/flush_cache`, `/start_profile` (it
writes a synthetic trace once the steps asked for are done) and `/stop_profile`, and
prints SGLang-format "Decode batch" lines. Its "model" answers with every 7-digit number
of the prompt (so single-needle tasks are answered right), then " x" until the requested
length. With `--sparse-mode` it also reports a `psa` block with a blocks-read fraction.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import re
import sys
import time
from pathlib import Path

WORD_RE = r"\w+|[^\w\s]+"
STEP_S = float(os.environ.get("FAKE_SGLANG_STEP_S", "0.002"))  # one fake decode step


def make_tokenizer(folder: Path, texts: list[str]) -> Path:
    """A word-level fast tokenizer whose vocabulary holds every word of `texts`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "x": 1}
    for t in texts:
        for w in re.findall(WORD_RE, t):
            vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Split(Regex(WORD_RE), behavior="isolated"),
        ]
    )
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"})
    )
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "hidden_size": 64,
                "vocab_size": len(vocab),
            }
        )
    )
    return folder


class WordCounter:
    """Counts tokens as the word-level tokenizer does, without loading it."""

    def encode(self, s: str, add_special_tokens: bool = True) -> list[int]:
        return [0] * len(re.findall(WORD_RE, s))


def reply_words(prompt: str, n: int) -> list[str]:
    nums = re.findall(r"\b\d{7}\b", prompt)
    words = [w for num in dict.fromkeys(nums) for w in (num, ",")][: max(0, n - 1)]
    return (words + ["x"] * n)[:n]


def main() -> None:
    from aiohttp import web

    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--sparse-mode")
    ap.add_argument("--max-total-tokens", type=int, default=1_000_000)
    args, _ = ap.parse_known_args()
    state = {"running": 0, "generated": 0, "steps": 0, "tic": time.perf_counter(), "reads": 0}
    profile = {}  # a started profile: steps to record, first step, output folder
    cache: list[list[str]] = []  # prompts and prompts with their answers since the flush

    def write_trace() -> None:
        """SGLang's profiler's Chrome trace, GPU activity: per step one graph launch, an
        attention kernel of 30 us and a GEMM of 50 us, then 20 us of nothing."""
        events = []
        for i in range(profile["steps"]):
            t = 100.0 * i
            events.append(
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t, "dur": 5.0}
            )
            events.append(
                {"ph": "X", "cat": "kernel", "name": "fake_attention_kernel", "ts": t, "dur": 30.0}
            )
            events.append(
                {"ph": "X", "cat": "kernel", "name": "fake_gemm", "ts": t + 30, "dur": 50.0}
            )
        folder = Path(profile["dir"])
        folder.mkdir(parents=True, exist_ok=True)
        with gzip.open(folder / "fake-TP-0.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": events}, f)
        profile.clear()

    def log(msg: str) -> None:
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}", flush=True)

    def decode_line() -> None:
        now = time.perf_counter()
        gen = state["generated"] / max(1e-9, now - state["tic"])
        state["generated"], state["tic"] = 0, now
        log(
            f"Decode batch, #running-req: {state['running']}, #token: {state['running'] * 100}, "
            f"token usage: 0.01, cuda graph: {args.sparse_mode is None}, "
            f"gen throughput (token/s): {gen:.2f}, #queue-req: 0"
        )

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(args.model_path) / "tokenizer.json"))

    async def generate(request):
        body = await request.json()
        n = body["sampling_params"]["max_new_tokens"]
        # a prompt sent as token ids reads as its decoded text, as SGLang's server reads it
        text = body["text"] if "text" in body else tokenizer.decode(body["input_ids"])
        log(f"generate: prompt as {'text' if 'text' in body else 'input_ids'}")
        words = reply_words(text, n)
        prompt = re.findall(WORD_RE, text)
        cached = max((len(os.path.commonprefix([prompt, seq])) for seq in cache), default=0)
        cache.extend([prompt, prompt + words])
        state["running"] += 1
        try:
            if not body.get("stream"):
                await asyncio.sleep(STEP_S * n)
                state["generated"] += n
                meta = {"completion_tokens": n, "cached_tokens": cached}
                return web.json_response({"text": " ".join(words), "meta_info": meta})
            resp = web.StreamResponse()
            await resp.prepare(request)
            for i in range(1, n + 1):
                await asyncio.sleep(STEP_S)
                state["generated"] += 1
                state["steps"] += 1
                state["reads"] += 1
                if state["steps"] % 10 == 0:
                    decode_line()
                if profile and state["steps"] - profile["from"] >= profile["steps"]:
                    write_trace()
                meta = {"completion_tokens": i, "cached_tokens": cached}
                chunk = {"text": " ".join(words[:i]), "meta_info": meta}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            state["running"] -= 1

    async def info(request):
        internal = {"memory_usage": {"kvcache": 1.0}}
        if args.sparse_mode:
            internal["psa"] = {
                "blocks_read_fraction": 0.25,
                "residency": {
                    "units_read_hbm": 3 * state["reads"],
                    "units_read_host": state["reads"],
                },
            }
        return web.json_response(
            {
                "max_total_num_tokens": args.max_total_tokens,
                "page_size": 1,
                "internal_states": [internal],
            }
        )

    async def ok(request):
        return web.Response(text="ok")

    async def flush_cache(request):
        log(f"flush_cache: {len(cache)} cached sequences dropped")
        cache.clear()
        return web.Response(text="ok")

    async def start_profile(request):
        body = await request.json()
        profile.update(steps=body["num_steps"], dir=body["output_dir"], **{"from": state["steps"]})
        return web.Response(text="Start profiling.\n")

    async def stop_profile(request):
        if profile:
            write_trace()
        return web.Response(text="Stop profiling.\n")

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", ok)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/start_profile", start_profile)
    app.router.add_post("/stop_profile", stop_profile)
    app.router.add_get("/get_server_info", info)
    app.router.add_get("/server_info", info)
    log(f"fake sglang on {args.port} serving {args.model_path}")
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    sys.exit(main())
