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

Two workloads share prompt text between requests, so that prefix caching matters:
shared documents (`documents`: each document is asked several different questions,
every prompt of a document starting with the same bytes, the whole document) and
multi-turn chat (`turns`: a conversation's turn is the whole history so far, its
scripted answers included, plus a new user message, so each prompt starts with the
bytes of the one before). Chat turns are sent by this benchmark's own driver, in
order, each after the previous answer returned and the user's seeded think time
(`Row.wait_s`); the dataset file keeps them in conversation order.
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

from sglang_psa.eval.tasks import (
    CITIES,
    GENERATORS,
    Builder,
    Task,
    chat_turns_text,
    fact_document,
)

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
    # f: the prompts are `documents` documents of prompt_tokens, each asked
    # prompts // documents different questions (requests arrive at `rates`)
    documents: int = 0
    # g: the prompts are prompts // turns conversations of `turns` turns, the first turn
    # prompt_tokens[0] long and the last prompt_tokens[-1]; conversations start at
    # `rates`, a user thinks `think_s` on average (0.5x to 1.5x, seeded) before a next turn
    turns: int = 0
    think_s: float = 0.0
    # capped: requests the tiered home's host tier is sized for (None: every request)
    host_requests: int | None = None

    @property
    def is_sweep(self) -> bool:
        """Requests arrive at rates (one timed run per rate), not all at once."""
        return any(not math.isinf(r) for r in self.rates)

    @property
    def fixed_output(self) -> int | None:
        return self.output_tokens[0] if len(self.output_tokens) == 1 else None

    @property
    def conversations(self) -> int:
        return self.prompts // self.turns if self.turns else 0

    @property
    def max_batch(self) -> int:
        """The most requests in flight at once (decode graphs are captured up to it): a
        conversation has one turn in flight at a time."""
        return self.conversations or self.prompts

    @property
    def prefix_set_tokens(self) -> int | None:
        """Tokens of the prompt text requests share: every document (f), every
        conversation's whole history (g); None for workloads that share none."""
        if self.documents:
            return self.documents * max(self.prompt_tokens)
        return self.conversations * max(self.prompt_tokens) if self.turns else None

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

# Plain SGLang at each backend, its own host tier, and sglang-psa at both KV homes.
PREFIX_SYSTEMS = (
    "plain",
    "plain_fa3",
    "plain_flashinfer",
    "plain_hicache",
    "plain_hicache_fa3",
    "psa",
    "psa_tiered_prefix",
)
CAPPED = Workload(
    "b",
    "capacity: workload a with the HBM for KV capped so that plain SGLang holds 4 "
    "requests; every system gets the same HBM",
    "qwen2.5-0.5b",
    32,
    (28_000,),
    (1024,),
    ("plain", "plain_fa3", "plain_flashinfer", "psa_tiered_prefix", "topk_tiered", "plain_hicache"),
    kv_cap_requests=4,
)
SHARED = Workload(
    "f",
    "shared documents: 10 documents of 16K tokens, each asked 12 different questions "
    "(120 requests, 64 output tokens), Poisson arrivals at 16 per s; a document's "
    "questions share its prompt prefix",
    "qwen2.5-0.5b",
    120,
    (16_000,),
    (64,),
    PREFIX_SYSTEMS,
    rates=(16.0,),
    kinds=("magic_number", "person_city"),
    documents=10,
)
CHAT = Workload(
    "g",
    "multi-turn chat: 16 conversations of 5 turns whose history grows from 16K to 28K "
    "tokens (3K of new material a turn), 128 output tokens; conversations start at 2 per "
    "s (Poisson), each turn sent when the previous answer returned and the user thought "
    "1-3 s",
    "qwen2.5-0.5b",
    80,
    (16_000, 28_000),
    (128,),
    PREFIX_SYSTEMS,
    rates=(2.0,),
    kinds=("magic_number", "person_city"),
    turns=5,
    think_s=2.0,
)

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
                "psa_r1",
                "topk",
                "topk_r8",
                "psa_eps1",
                "psa_tiered",
                "psa_tiered_prefix",
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
            (
                "plain",
                "plain_fa3",
                "plain_flashinfer",
                "plain_repeat",
                "psa",
                "psa_r1",
                "psa_certified",
                "psa_certified_unaudited",
                "topk",
                "topk_r8",
            ),
        ),
        Workload(
            "a2k",
            "the host loop's floor: 32 x 2K-token prompts, 1024 output tokens, all at once; "
            "attention is a small part of each step here, so a step longer than the GPU's "
            "work (a --profile-decode run's busy time) is the scheduler's host time at batch 32",
            "qwen2.5-0.5b",
            32,
            (2_000,),
            (1024,),
            ("plain", "plain_fa3", "plain_flashinfer", "psa", "topk"),
        ),
        CAPPED,
        dataclasses.replace(
            CAPPED,
            name="b256",
            what="capacity at short outputs: b with 256 output tokens (HBM for KV capped so "
            "that plain SGLang holds 4 of these requests; every system gets that HBM)",
            output_tokens=(256,),
            systems=tuple(s for s in CAPPED.systems if s != "topk_tiered"),
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
        SHARED,
        dataclasses.replace(
            SHARED,
            name="f_capped",
            what="f with the HBM for KV capped so that plain SGLang holds 2 requests (the "
            "documents take about 5x that); every system gets that HBM",
            kv_cap_requests=2,
            host_requests=16,
        ),
        CHAT,
        dataclasses.replace(
            CHAT,
            name="g_capped",
            what="g with the HBM for KV capped so that plain SGLang holds 3 requests of the "
            "longest turn (the histories take about 5x that); every system gets that HBM",
            kv_cap_requests=3,
            host_requests=16,
        ),
    )
}
# Answers on a second, larger real model (head dim 128, 6 query heads a KV head): a16 and
# a on Qwen2.5-Coder-1.5B, plain against psa and top-k, and a second plain server for
# plain's own identical fraction.
QWEN_1P5B = "qwen2.5-1.5b"
for _w in (WORKLOADS["a16"], WORKLOADS["a"]):
    WORKLOADS[f"{_w.name}_1p5b"] = dataclasses.replace(
        _w,
        name=f"{_w.name}_1p5b",
        what=f"{_w.name} on {QWEN_1P5B} (head dim 128): answers and identical completions",
        model=QWEN_1P5B,
        systems=("plain", "plain_fa3", "plain_repeat", "psa", "topk"),
    )


@dataclass(frozen=True)
class Row:
    """One request of a dataset: its prompt and what scores the answer."""

    prompt: str
    prompt_len: int
    output_len: int
    kind: str
    answers: tuple[str, ...]
    answer_tokens: int  # tokens of the completion the answer is looked for in
    group: int | None = None  # f: the document asked about; g: the conversation
    turn: int | None = None  # g: the turn of its conversation, from 0
    wait_s: float = 0.0  # g: the user's think time between the previous answer and this turn


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
    8 requests (f: 2 documents; g: 2 conversations of at most 4 turns), prompts and
    outputs 1/16 as long, two rates 16 times higher, think times 16 times shorter."""
    turns = min(w.turns, 4)
    return dataclasses.replace(
        w,
        prompts=min(w.prompts, 8 if not turns else 2 * turns),
        prompt_tokens=tuple(sorted({max(512, n // 16) for n in w.prompt_tokens})),
        output_tokens=tuple(sorted({max(8, n // 16) for n in w.output_tokens})),
        rates=tuple(16 * r for r in w.rates[:2]),
        documents=min(w.documents, 2),
        turns=turns,
        think_s=w.think_s / 16,
    )


def build_rows(w: Workload, tok) -> list[Row]:
    """The workload's requests: task `i` has kind `kinds[i % len]`, a prompt length and an
    output length drawn with the workload's seed; token counts are made distinct. Shared
    documents (f) and chat (g) are built by `shared_document_rows` and `chat_rows`."""
    if w.documents:
        return shared_document_rows(w, tok)
    if w.turns:
        return chat_rows(w, tok)
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
        prompt, n, _ = distinct_prompt(tok, [], task.prompt, task.question, seen)
        check_length(w, i, n, target)
        rows.append(Row(prompt, n, out, kind, task.answers, task.max_new_tokens))
    return rows


def distinct_prompt(
    tok, history: list[str], text: str, question: str, seen: set[int]
) -> tuple[str, int, str]:
    """The prompt of a conversation's `history` followed by the user message `text`, a pad
    of FILLER_WORDs, a blank line and `question` (`eval.tasks.chat_turns_text`), with the
    shortest pad whose token count is not in `seen` (then added to it): the prompt, its
    token count and the user message."""
    pad = ""
    while True:
        message = text + pad + "\n\n" + question
        prompt = chat_turns_text(tok, [*history, message])
        n = len(tok.encode(prompt))
        if n not in seen:
            seen.add(n)
            return prompt, n, message
        pad += FILLER_WORD


def check_length(w: Workload, i: int, n: int, target: int) -> None:
    if n > target + TEMPLATE_SLACK:
        raise ValueError(
            f"workload {w.name}: prompt {i} has {n} tokens, more than {target} + "
            f"{TEMPLATE_SLACK}; the task generator overshot"
        )


GROUP_SPACING = 64  # tokens between the target lengths of two documents or conversations


def shared_document_rows(w: Workload, tok) -> list[Row]:
    """f: `w.documents` fact documents, each asked prompts // documents different
    questions (`eval.tasks.fact_document`: magic numbers and person facts). Every prompt
    of a document is the chat template's start, the document, then its own pad and
    question: the document's bytes are the same in all of them. Document `d` aims at
    GROUP_SPACING * d tokens less than the others before it, so that pads stay short."""
    questions = w.prompts // w.documents
    if questions * w.documents != w.prompts or questions > len(CITIES):
        raise ValueError(
            f"workload {w.name}: {w.prompts} prompts are not {w.documents} documents of at "
            f"most {len(CITIES)} questions each"
        )
    count = counter(tok)
    target = max(w.prompt_tokens)
    out_rng = random.Random(f"serving/shared/{w.seed}/outputs")
    seen: set[int] = set()
    rows = []
    for d in range(w.documents):
        builder = Builder(count, random.Random(f"serving/shared/{w.seed}/document/{d}"))
        n_tokens = target - TEMPLATE_SLACK // 2 - GROUP_SPACING * d
        doc, tasks = fact_document(builder, n_tokens, (questions + 1) // 2, questions // 2)
        for task in tasks:
            prompt, n, _ = distinct_prompt(tok, [], doc, task.question, seen)
            check_length(w, len(rows), n, target)
            out = out_rng.choice(w.output_tokens)
            rows.append(_row(task, prompt, n, out, group=d))
    return rows


def chat_rows(w: Workload, tok) -> list[Row]:
    """g: `w.conversations` conversations of `w.turns` turns, in conversation order. Turn 0
    pastes a fact document of prompt_tokens[0] and asks one of its magic numbers; each
    later turn pastes a new section (one magic number under a city new to the
    conversation) so that the prompt grows evenly to prompt_tokens[-1], and asks the new
    section's number (even turns) or where a person of the first document lives (odd
    turns: an answer from far back in the history). A turn's prompt is the whole history,
    the scripted answers of earlier turns (each the right answer) included, plus the new
    message, so it starts with the bytes of the turn before. Conversation `c` aims at
    GROUP_SPACING * c tokens less than the others before it, so that pads stay short."""
    first, last = w.prompt_tokens[0], w.prompt_tokens[-1]
    step = (last - first) / max(1, w.turns - 1)
    count = counter(tok)
    seen: set[int] = set()
    rows = []
    for c in range(w.conversations):
        rng = random.Random(f"serving/chat/{w.seed}/conversation/{c}")
        builder = Builder(count, rng)
        n_tokens = first - TEMPLATE_SLACK // 2 - GROUP_SPACING * c
        doc, facts = fact_document(builder, n_tokens, 1, w.turns // 2)
        number, people = facts[0], facts[1:]
        keys = [k for k in CITIES if not _asks(number, k)]
        history: list[str] = []
        have = 0  # tokens of the previous turn's prompt
        for t in range(w.turns):
            target = round(first + t * step) - GROUP_SPACING * c
            if t == 0:
                section, task = doc, number
            else:
                n_tokens = target - have - TEMPLATE_SLACK // 2
                section, (task,) = fact_document(builder, max(32, n_tokens), 1, 0, keys)
                keys = [k for k in keys if not _asks(task, k)]
                if t % 2:
                    task = people[t // 2]
            prompt, n, message = distinct_prompt(tok, history, section, task.question, seen)
            check_length(w, len(rows), n, target)
            wait = 0.0 if t == 0 else w.think_s * rng.uniform(0.5, 1.5)
            out = rng.choice(w.output_tokens)
            rows.append(_row(task, prompt, n, out, group=c, turn=t, wait_s=wait))
            history += [message, task.answers[0]]
            have = n
    return rows


def _asks(task: Task, city: str) -> bool:
    """Is `task` the question about `city`'s magic number?"""
    return task.question.startswith(f"What is the special magic number for {city}?")


def _row(task: Task, prompt: str, n: int, out: int, **where) -> Row:
    return Row(prompt, n, out, task.kind, task.answers, task.max_new_tokens, **where)


def conversation_starts(w: Workload, rate: float) -> list[float]:
    """g: seconds from the timed run's start at which each conversation sends its first
    turn: Poisson arrivals at `rate` per second (seeded; all at 0 for an infinite rate),
    the first at 0."""
    rng = random.Random(f"serving/chat/{w.seed}/starts/{rate:g}")
    starts, t = [], 0.0
    for _ in range(w.conversations):
        starts.append(t)
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    return starts


def conversations(rows: list[Row]) -> list[list[Row]]:
    """g: the rows of each conversation, by conversation, in turn order."""
    by: dict[int, list[Row]] = {}
    for r in rows:
        by.setdefault(r.group, []).append(r)
    return [sorted(turns, key=lambda r: r.turn) for _, turns in sorted(by.items())]


def write_dataset(rows: list[Row], tok, path: Path) -> Path:
    """`path` (JSONL, SGLang's custom format) and `path.meta.json` (tasks by token count,
    in the rows' order; f and g add each prompt's group, g its turn and wait)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            turns = [{"content": r.prompt}, {"content": text_of_tokens(tok, r.output_len)}]
            f.write(json.dumps({"conversations": turns}) + "\n")
    meta = {str(r.prompt_len): _task_meta(r) for r in rows}
    meta_path(path).write_text(json.dumps(meta, indent=1) + "\n")
    return path


def _task_meta(r: Row) -> dict:
    meta = {
        "kind": r.kind,
        "answers": list(r.answers),
        "answer_tokens": r.answer_tokens,
        "output_len": r.output_len,
    }
    if r.group is not None:
        meta["group"] = r.group
    if r.turn is not None:
        meta |= {"turn": r.turn, "wait_s": r.wait_s}
    return meta


def load_rows(dataset: Path) -> list[Row]:
    """The rows a dataset was written from (prompts from the JSONL, the rest from the
    sidecar, both in the rows' order)."""
    lines = dataset.read_text().splitlines()
    meta = json.loads(meta_path(dataset).read_text())
    if len(lines) != len(meta):
        raise ValueError(f"{dataset}: {len(lines)} prompts but {len(meta)} tasks in its sidecar")
    rows = []
    for line, (n, m) in zip(lines, meta.items()):
        prompt = json.loads(line)["conversations"][0]["content"]
        task = Task(m["kind"], "", "", tuple(m["answers"]), m["answer_tokens"])
        where = {k: m[k] for k in ("group", "turn", "wait_s") if k in m}
        rows.append(_row(task, prompt, int(n), m["output_len"], **where))
    return rows


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


def until_end(tok, generated: str) -> str:
    """The completion as a user would get it: up to and including the first special token
    in its text (the end of the turn; the benchmark ignores EOS to fix the output length,
    and asks the server to keep special tokens in the text so that the end shows), or all
    of it when none shows (a server that skipped them, or an answer that never ended)."""
    marks = set(getattr(tok, "all_special_tokens", ()))
    marks |= {t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if t.special}
    if getattr(tok, "unk_token", None) != getattr(tok, "eos_token", None):
        marks.discard(getattr(tok, "unk_token", None))  # a word the vocabulary lacks
    ends = [i + len(t) for t in marks if t and (i := generated.find(t)) >= 0]
    return generated[: min(ends)] if ends else generated


def answer_ids(tok, generated: str) -> list[int]:
    """The first ANSWER_WINDOW token ids of a completion up to its end (`until_end`, the
    end-of-turn token included), re-tokenized from its text. Tokens the model writes past
    its end (EOS ignored) are not compared: they diverge between any two servers."""
    return tok.encode(until_end(tok, generated), add_special_tokens=False)[:ANSWER_WINDOW]


def is_correct(tok, generated: str, task: dict) -> bool:
    """`Task.score` on the completion's first `answer_tokens` tokens up to its end: with EOS
    ignored the model keeps writing past its answer, so only the answer counts."""
    ids = tok.encode(until_end(tok, generated), add_special_tokens=False)
    head = tok.decode(ids[: task["answer_tokens"]], skip_special_tokens=True)
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
