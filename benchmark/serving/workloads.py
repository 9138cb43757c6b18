"""The serving benchmark's workloads and their datasets (seeded, built from `eval.tasks`).

A workload is what the client sends: how many requests, how long their prompts
and outputs are, at what arrival rate. Its dataset is a JSONL file in SGLang's
`custom` format (`{"conversations": [user, assistant]}`; the user turn is the
prompt text, already through the chat template; the assistant turn is text of
exactly the output length in tokens, which `bench_serving` measures when no
fixed length is given) plus a sidecar `.meta.json` holding each prompt's task
(kind and answers), keyed by its token count.

Contract: every prompt of a dataset has a distinct token count
(`tokenizer.encode(prompt)`, as `bench_serving` counts it). `bench_serving`
shuffles the dataset and reports results in its own order with each request's
`input_len`, so the count is how a result finds its task.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sglang_psa.eval.tasks import GENERATORS, Builder, Task, chat_text

# Task kinds the test model solves at least sometimes with dense attention (README,
# "Measured so far"); multi-value needles and common words fail even dense.
KINDS = ("niah_1key", "niah_4key", "variable_tracking", "doc_qa")
ANSWER_WINDOW = 64  # completions are scored and compared on their first 64 tokens
FILLER_WORD = " Indeed."  # appended to a document to make its token count unique


@dataclass(frozen=True)
class Workload:
    """What the client sends in one timed run (or one run per rate)."""

    name: str
    what: str
    model: str  # a key of sglang_psa.models.MODELS, or LLAMA_8B_DUMMY
    prompts: int  # requests per timed run (d: the most; the batch is set by capacity)
    prompt_tokens: tuple[int, ...]  # one value: fixed; several: drawn per request
    output_tokens: tuple[int, ...]
    systems: tuple[str, ...]  # benchmark.serving.systems names, plain first
    rates: tuple[float, ...] = (math.inf,)  # requests/s; inf: all at once
    kv_cap_requests: int | None = None  # b: HBM for KV holds this many plain requests
    batch_from_capacity: bool = False  # d: as many as plain SGLang holds at once
    seed: int = 0
    kinds: tuple[str, ...] = field(default=KINDS)

    @property
    def is_sweep(self) -> bool:
        """Requests arrive at rates (one timed run per rate), not all at once."""
        return any(not math.isinf(r) for r in self.rates)

    @property
    def fixed_output(self) -> int | None:
        return self.output_tokens[0] if len(self.output_tokens) == 1 else None

    @property
    def max_request_tokens(self) -> int:
        """KV tokens the longest request can hold (prompt, chat template, output)."""
        return max(self.prompt_tokens) + max(self.output_tokens) + TEMPLATE_SLACK

    def to_json(self) -> dict:
        d = asdict(self)
        d["rates"] = ["inf" if math.isinf(r) else r for r in self.rates]
        return d


LLAMA_8B_DUMMY = "llama3.1-8b-dummy"
TEMPLATE_SLACK = 256  # tokens a prompt may exceed its target by (template, question)

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "a",
            "decode-heavy, long context: 32 x 28K-token prompts, 1024 output tokens, all at once",
            "qwen2.5-0.5b",
            32,
            (28_000,),
            (1024,),
            (
                "plain",
                "plain_fa3",
                "plain_flashinfer",
                "psa",
                "topk",
                "topk_r8",
                "psa_eps1",
                "psa_tiered",
                "psa_tiered_uva",
                "plain_eager",
            ),
        ),
        Workload(
            "a16",
            "continuity with the issue's first table: 32 x 16K-token prompts, 256 output "
            "tokens, all at once",
            "qwen2.5-0.5b",
            32,
            (16_000,),
            (256,),
            ("plain", "plain_fa3", "plain_flashinfer", "psa", "topk", "topk_r8"),
        ),
        Workload(
            "b",
            "capacity: workload a with the HBM for KV capped so that plain SGLang holds 4 "
            "requests; every system gets the same HBM",
            "qwen2.5-0.5b",
            32,
            (28_000,),
            (1024,),
            ("plain", "psa_tiered_uva", "topk_tiered", "plain_hicache"),
            kv_cap_requests=4,
        ),
        Workload(
            "c",
            "Poisson arrivals of a mixed-length mix (4K-28K prompts, 64-1024 outputs) at a "
            "sweep of rates; goodput under TTFT and TPOT objectives",
            "qwen2.5-0.5b",
            24,
            (4_000, 8_000, 12_000, 16_000, 20_000, 24_000, 28_000),
            (64, 128, 256, 512, 1024),
            ("plain", "psa"),
            # Plain SGLang met both strict objectives for every request up to 2/s on the H100:
            # the sweep goes on to where it saturates.
            rates=(1.0, 2.0, 4.0, 8.0),
        ),
        Workload(
            "d",
            "speed only at an 8B shape: Llama-3.1-8B layer shapes with dummy weights, 32K "
            "prompts at the largest batch plain SGLang holds, 256 output tokens; topk reads "
            "a fixed budget whatever the weights",
            LLAMA_8B_DUMMY,
            24,
            (32_000,),
            (256,),
            ("plain", "plain_fa3", "plain_flashinfer", "topk"),
            batch_from_capacity=True,
        ),
        Workload(
            "e",
            "capacity at an 8B shape: Llama-3.1-8B layer shapes with dummy weights, 20 x "
            "32K-token prompts, 1024 output tokens, all at once, the HBM for KV capped so "
            "that plain SGLang holds 10; the tiered home holds every request in its host "
            "tier; topk reads a fixed budget whatever the weights",
            LLAMA_8B_DUMMY,
            20,
            (32_000,),
            (1024,),
            ("plain", "topk_tiered"),
            kv_cap_requests=10,
        ),
    )
}


@dataclass(frozen=True)
class Row:
    """One request of a dataset: its prompt and what scores the answer."""

    prompt: str
    prompt_len: int
    output_len: int
    kind: str
    answers: tuple[str, ...]
    answer_tokens: int  # tokens of the completion the answer is looked for in


def text_of_tokens(tok, n: int) -> str:
    """Text that `tok.encode` counts as exactly `n` tokens (the assistant turn that sets a
    request's output length in SGLang's custom dataset)."""
    unit = " x"
    text = unit * n
    for _ in range(64):
        have = len(tok.encode(text))
        if have == n:
            return text
        text = text[: len(text) - len(unit) * (have - n)] if have > n else text + unit * (n - have)
    raise ValueError(f"could not make text of exactly {n} tokens with this tokenizer")


def counter(tok) -> Callable[[str], int]:
    """Tokens of a text fragment, without special tokens (what the task builder measures)."""
    return lambda s: len(tok.encode(s, add_special_tokens=False))


def smoke(w: Workload) -> Workload:
    """A small, fast version of `w` for checking the whole path before a full run: at most
    8 requests, prompts and outputs 1/16 as long, two rates 16 times higher."""
    return dataclasses.replace(
        w,
        prompts=min(w.prompts, 8),
        prompt_tokens=tuple(sorted({max(512, n // 16) for n in w.prompt_tokens})),
        output_tokens=tuple(sorted({max(8, n // 16) for n in w.output_tokens})),
        rates=tuple(16 * r for r in w.rates[:2]),
    )


def build_rows(w: Workload, tok) -> list[Row]:
    """The workload's requests: task `i` has kind `kinds[i % len]`, a prompt length and an
    output length drawn with the workload's seed; token counts are made distinct."""
    rng = random.Random(f"serving/{w.name}/{w.seed}")
    count = counter(tok)
    seen: set[int] = set()
    rows = []
    for i in range(w.prompts):
        kind = w.kinds[i % len(w.kinds)]
        target = rng.choice(w.prompt_tokens)
        out = rng.choice(w.output_tokens)
        builder = Builder(count, random.Random(f"{w.seed}/{kind}/{i}/{target}"))
        task: Task = GENERATORS[kind](builder, target - TEMPLATE_SLACK // 2)
        doc = task.prompt
        while True:
            prompt = chat_text(tok, doc, task.question)
            n = len(tok.encode(prompt))
            if n not in seen:
                break
            doc += FILLER_WORD
        if n > target + TEMPLATE_SLACK:
            raise ValueError(
                f"workload {w.name}: prompt {i} has {n} tokens, more than {target} + "
                f"{TEMPLATE_SLACK}; the task generator overshot"
            )
        seen.add(n)
        rows.append(Row(prompt, n, out, kind, task.answers, task.max_new_tokens))
    return rows


def write_dataset(rows: list[Row], tok, path: Path) -> Path:
    """`path` (JSONL, SGLang's custom format) and `path.meta.json` (tasks by token count)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            turns = [{"content": r.prompt}, {"content": text_of_tokens(tok, r.output_len)}]
            f.write(json.dumps({"conversations": turns}) + "\n")
    meta = {
        str(r.prompt_len): {
            "kind": r.kind,
            "answers": list(r.answers),
            "answer_tokens": r.answer_tokens,
            "output_len": r.output_len,
        }
        for r in rows
    }
    meta_path(path).write_text(json.dumps(meta, indent=1) + "\n")
    return path


def meta_path(dataset: Path) -> Path:
    return dataset.with_suffix(".meta.json")


def load_meta(dataset: Path) -> dict[int, dict]:
    return {int(k): v for k, v in json.loads(meta_path(dataset).read_text()).items()}


def ensure_dataset(w: Workload, tok, work_dir: Path) -> Path:
    """The workload's dataset under `work_dir`, built once per workload definition (seeded:
    a rebuild is equal)."""
    # Keyed by the workload and the tokenizer (its size and how it splits a probe text):
    # the sidecar maps token counts to tasks, which only hold for the tokenizer counting.
    key = [w.to_json(), len(tok), tok.encode("Tokenizer fingerprint: 0123456789, Kraków.")]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    path = work_dir / "datasets" / f"{w.name}-{digest}.jsonl"
    if not (path.exists() and meta_path(path).exists()):
        write_dataset(build_rows(w, tok), tok, path)
    return path


def answer_ids(tok, generated: str) -> list[int]:
    """The first ANSWER_WINDOW token ids of a completion, re-tokenized from its text."""
    return tok.encode(generated, add_special_tokens=False)[:ANSWER_WINDOW]


def is_correct(tok, generated: str, task: dict) -> bool:
    """`Task.score` on the completion's first `answer_tokens` tokens: with EOS ignored the
    model keeps writing past its answer, so only the answer counts."""
    head = tok.decode(tok.encode(generated, add_special_tokens=False)[: task["answer_tokens"]])
    return Task(task["kind"], "", "", tuple(task["answers"]), task["answer_tokens"]).score(head)


# Llama-3.1-8B's layer shapes; the vocabulary is the test model's tokenizer's (151,936
# entries instead of 128,256) so that SGLang's client and server can share that tokenizer.
LLAMA_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def prepare_model(key: str, work_dir: Path) -> Path:
    """The model folder a workload serves: a converted test model, or for the 8B shape a
    folder with Llama-3.1-8B's config and the test model's tokenizer (no weights: it is
    served with `--load-format dummy`)."""
    from sglang_psa.models import DEFAULT_MODEL, ensure_model

    if key != LLAMA_8B_DUMMY:
        return ensure_model(key)
    src = ensure_model(DEFAULT_MODEL)
    folder = work_dir / "models" / LLAMA_8B_DUMMY
    folder.mkdir(parents=True, exist_ok=True)
    src_cfg = json.loads((src / "config.json").read_text())
    cfg = dict(LLAMA_8B_CONFIG, vocab_size=src_cfg["vocab_size"])
    for k in ("bos_token_id", "eos_token_id"):
        if k in src_cfg:
            cfg[k] = src_cfg[k]
    (folder / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            (folder / name).write_bytes((src / name).read_bytes())
    return folder


def kv_bytes(model_dir: Path) -> tuple[int, int]:
    """(K+V bytes, sglang-psa block-metadata bytes in HBM) per token, all layers, bf16, with
    the plugin's default configuration, as the plugin itself sizes them."""
    import torch

    from sglang_psa.config import PSAConfig
    from sglang_psa.mem_cache.kv_budget import metadata_bytes_per_token
    from sglang_psa.models import kv_bytes_per_token

    kv = kv_bytes_per_token(model_dir)
    return kv, metadata_bytes_per_token(kv, torch.bfloat16, PSAConfig())
