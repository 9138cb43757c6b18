"""Adaptive budget suite: quality against KV read, per decode policy, at mixed lengths.

    python benchmark/adaptive/run.py                                   # the suite (GPU host)
    python benchmark/adaptive/run.py --model smollm2-135m --lengths 1024,2048 \\
        --per-kind 1 --name adaptive_smoke                            # a CPU check of the path

Per task (`sglang_psa.eval.tasks`, every kind, each length): one dense prefill through
the transformers hook, then every policy at once, a batch row each: a 64-token greedy
completion (the task's answer scored, the tokens compared with dense's), then teacher
forcing along dense's tokens (the mean next-token KL from dense). `identical`: all 64
tokens equal dense's; `answer_identical`: equal up to the stop token, as a server that
stops there returns them (`first_divergence`: where a row's tokens first differ). A
policy's KV fraction counts what it reads: the blocks, plus the block metadata its
ranking reads for every block (key min and max, or the mean: 2 or 1 vectors per
`block_size` keys and values).

The baseline is the best single top-k budget, as an operator would set it: the smallest
budget whose accuracy over the suite is within `--accuracy-slack` of dense's and whose
completions equal dense's for at least `--identical-min` of the tasks. Writes
`benchmark/results/NAME.json` (default `adaptive_budget`) with the summary keys
`kv_fraction_psa`, `kv_fraction_best_topk`, `kv_ratio_psa_vs_best_topk`,
`accuracy_delta_psa_vs_dense`, `identical_fraction_psa`, `answer_identical_fraction_psa`,
`mean_kl_psa`, `kv_fraction_certified_16k`, `identical_fraction_floor` (ε 1: every block
read, the floor under identical completions), and a plot of KL against KV fraction per
policy.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from sglang_psa.config import PSAConfig
from sglang_psa.eval.results import dump_result, git_commit, write_result
from sglang_psa.eval.runner import chat_parts, stop_ids
from sglang_psa.eval.tasks import GENERATORS, make_tasks
from sglang_psa.hf.attention import DecodePolicy
from sglang_psa.hf.decode import Session, load_model
from sglang_psa.models import DEFAULT_MODEL, MODELS, ensure_model

RESULTS = Path(__file__).resolve().parents[1] / "results"
COMPLETION = 64  # tokens compared with dense's


# The suite's first default (ε 0.98, 16-bit bounds, a fixed first wave): the base of its
# policies, which keep their labels (the current default, `PSAConfig()`, is among them).
FIRST = PSAConfig(threshold=0.98, bound_bits=16, wave_fraction=0.0, max_read_fraction=1.0)


# The current default's waves on FIRST: 8-bit bounds, a first wave of 1/4 of the blocks up
# to 128 (no read cap).
WAVES = FIRST.replace(bound_bits=8, wave_fraction=0.25, max_first_wave_blocks=128)


def floor_policy() -> DecodePolicy:
    """ε 1 in the default's waves, no read cap: every block read, so only the order of
    summation differs from dense (the suite's floor under identical completions)."""
    return DecodePolicy("psa", WAVES.replace(threshold=1.0))


def policies(budgets: list[int]) -> list[DecodePolicy]:
    """Dense first (the reference), the suite's first default psa policy second, then the
    others, each family in a row (`DecodePolicy.group`): one batched call per family and
    layer. The current default (`PSAConfig()`) is the ε 0.98 row with a first wave of 1/4
    of the blocks up to 128 (`-wf4-fw128`).

    Candidates beside the default, from the CPU runs at 4K and 8K and the H100 probe at
    16K: lower ε (covering 98% of a diffuse head's mass is more than an answer needs), a
    cap on the tokens read, a smaller first wave (16 blocks are 12% of a 4K context before
    any estimate), key bounds in 8 bits (half the metadata bytes, which are a third of
    what psa 0.8 reads at 16K) and both together, the certified rule. Dropped after those
    runs: 64-token blocks (a worse KL per byte at every ε) and caps on the lower ε (they
    did what the cap's top-k does)."""
    base = FIRST
    small = base.replace(wave_blocks=4, wave_growth=1.5)
    out = [DecodePolicy("dense", base), DecodePolicy("psa", base)]
    out += [DecodePolicy("psa", base.replace(threshold=e)) for e in (0.8, 0.85, 0.9, 0.95)]
    out.append(DecodePolicy("psa", base.replace(threshold=0.9), cap_tokens=2048))
    out += [DecodePolicy("psa", small.replace(threshold=e), tag="-w4") for e in (0.85, 0.9)]
    q8, small_q8 = base.replace(bound_bits=8), small.replace(bound_bits=8)
    out += [DecodePolicy("psa", q8.replace(threshold=e)) for e in (0.8, 0.85, 0.9)]
    out += [DecodePolicy("psa", small_q8.replace(threshold=e), tag="-w4") for e in (0.8, 0.85, 0.9)]
    out.append(DecodePolicy("psa", base.replace(threshold=0.95, stop_rule="certified")))
    out += [DecodePolicy("topk", base.replace(topk_tokens=b), b) for b in budgets]
    # After the H100 suite's first 56 tasks (all psa variants fell below top-k 4096's
    # identical completions at 24K and 32K while reading more there): the default with
    # 8-bit bounds, and a first wave of 64 blocks (2048 tokens) as a floor under ε.
    out += [DecodePolicy("psa", q8.replace(threshold=e)) for e in (0.95, 0.98)]
    floor = q8.replace(wave_blocks=64)
    out += [DecodePolicy("psa", floor.replace(threshold=e), tag="-w64") for e in (0.9, 0.95)]
    out += [DecodePolicy("topk", q8.replace(topk_tokens=b), b) for b in (2048, 4096)]
    # After that probe (a 64-block first wave fixed psa's KL at 24K-32K): a first wave
    # that grows with the context, 1/8 or 1/16 of its blocks, between 16 and 64.
    for e, f in ((0.9, 8), (0.95, 8), (0.95, 16)):
        out.append(DecodePolicy("psa", q8.replace(threshold=e, wave_fraction=1 / f)))
    # After the suite of that default (0.81 identical; top-k 4096, 0.89, was the only
    # policy near the 0.9 bar, its misses at 16K and 32K where the first wave's cap of 64
    # blocks reads half its 4096 tokens): higher ε, and first waves of 1/4 or a cap of
    # 128 blocks (top-k 4096's tokens at long context, then ε on top).
    for e, f, cap in (
        (0.98, 8, 64),
        (0.99, 8, 64),
        (0.95, 8, 128),
        (0.95, 4, 128),
        (0.98, 4, 128),
        (0.97, 4, 128),
        (0.98, 6, 128),
    ):
        wave = q8.replace(threshold=e, wave_fraction=1 / f, max_first_wave_blocks=cap)
        out.append(DecodePolicy("psa", wave))
    # After that default (0.35 of the KV at 0.91 identical): past its first wave every
    # wave was as large as the first (128 blocks at 16K-32K), read in full even where the
    # stop rule would have held a few blocks in. Later waves from 16 or 32 blocks
    # (`later_wave_blocks`, the rule checked after each), at ε 0.98 and 0.99, and with a
    # first-wave cap of 192 (a higher floor at 24K-32K, where the misses are).
    for e, cap, later in ((0.98, 128, 16), (0.98, 128, 32), (0.99, 128, 16), (0.98, 192, 16)):
        wave = q8.replace(
            threshold=e, wave_fraction=0.25, max_first_wave_blocks=cap, later_wave_blocks=later
        )
        out.append(DecodePolicy("psa", wave))
    # After those (later waves saved 5%: at 4K-8K a KV head either stops after its first
    # wave or never meets the rule and reads nearly every block; on CPU at 4K a third of
    # Qwen's heads read 95%): a cap on the share of its request's blocks a head reads.
    current = WAVES
    for later, frac in ((0, 0.5), (0, 0.4), (0, 0.3), (32, 0.4)):
        capped = current.replace(later_wave_blocks=later, max_read_fraction=frac)
        out.append(DecodePolicy("psa", capped))
    # After the 1.5B model's CPU pilots (benchmark/results/archive/ab_cpu_1p5b_4k*.json: the
    # uncapped default kept more identical completions than the 0.5 cap, at 0.57 of the KV
    # against 0.42): a looser cap, between the two.
    out.append(DecodePolicy("psa", current.replace(max_read_fraction=0.7)))
    # Carried onto the test model's suite, a 0.7 cap reads about 0.52x the best top-k's KV
    # (docs/limits.md, "The price of a 0.7 read cap"), past issue 47's 0.5x, where the 0.5
    # cap keeps 0.929 of completions identical, short of its 0.93: the cap between.
    out.append(DecodePolicy("psa", current.replace(max_read_fraction=0.6)))
    # The numerical floor under identical completions: every block read, in the default's
    # waves (what the order of summation alone changes against dense).
    out.append(floor_policy())
    # After the certified-bound study (benchmark/results/archive/certified_bound_cpu_16k.json: the
    # min/max bound certifies nothing, per-token key codes of 4-6 bits certify ε 0.9 at
    # 0.42-0.50 of the KV at 16K, codes counted): the certified rule on key codes, with a
    # first wave of 1/8 of the blocks and later waves from 16.
    cert = current.replace(stop_rule="certified", wave_fraction=0.125, later_wave_blocks=16)
    for e, bits in ((0.9, 5), (0.9, 4), (0.9, 6), (0.8, 5), (0.95, 5)):
        out.append(DecodePolicy("psa", cert.replace(threshold=e), code_bits=bits))
    return out


def metadata_fraction(policy: DecodePolicy, head_dim: int) -> float:
    """KV-equivalent bytes of the block metadata a sparse policy reads for every block:
    its vectors in the KV dtype (16 bits); 8-bit key bounds (`bound_bits`) a byte a
    channel plus a float32 scale per block and KV head; key codes (`code_bits`) that many
    bits a channel and token, against the token's K and V in 16 bits."""
    if policy.kind == "dense":
        return 0.0
    cfg = policy.cfg
    vectors = 1.0 if cfg.needs_key_mean else 0.0
    if cfg.needs_key_bounds:
        vectors += 1.0 + 2.0 / head_dim if cfg.bound_bits == 8 else 2.0
    return vectors / (2 * cfg.block_size) + policy.code_bits / 32


def run_task(
    session: Session, task, pols: list[DecodePolicy], stop: set[int], kernels: bool = False
) -> list[dict]:
    """Every policy on one prefilled task, all at once (a batch row each): a row per policy.

    Greedy completions of `COMPLETION` tokens (no early stop, to compare with dense's),
    then teacher forcing along dense's completion for the KL. `kernels`: the sparse
    policies run the server's Triton kernels (GPU) instead of the PyTorch reference."""
    dec = session.decode_rows(pols, COMPLETION, kernels)
    kls = session.forced_kl_rows(pols, dec.tokens[0], kernels)
    rows = []
    dense = dec.tokens[0]
    for p, tokens, kv, kl in zip(pols, dec.tokens, dec.kv_fractions, kls):
        answer = []
        for t in tokens:
            if t in stop:
                break
            answer.append(t)
        first = next((i for i, (a, b) in enumerate(zip(tokens, dense)) if a != b), None)
        rows.append(
            {
                "task": task.kind,
                "length": session.length,
                "policy": p.label,
                "correct": task.score(session.tok.decode(answer, skip_special_tokens=True)),
                "identical": tokens == dense,
                # what a server stopping at the stop token returns: the same answer, and
                # the stop where dense's is (a divergence after it is unseen)
                "answer_identical": first is None or first > len(answer),
                "first_divergence": first,
                "kl": kl,
                "kv_fraction": min(1.0, kv + metadata_fraction(p, session.head_dim)),
            }
        )
    return rows


def shard(jobs: list, spec: str | None) -> list:
    """The jobs of `--shard K/N`: every N-th of the suite's order from the K-th (None: all).
    The N shards partition the suite, each spread over its lengths as the whole is; run
    them as N processes on one GPU (the sparse rows are launch-bound, so processes fill
    each other's gaps), each with a NAME of its own, then `--combine` their files."""
    if spec is None:
        return jobs
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard {spec!r}: want K/N, e.g. 0/4") from None
    if not 0 <= k < n:
        raise ValueError(f"--shard {spec!r}: want 0 <= K < N")
    return jobs[k::n]


def table(rows: list[dict]) -> dict[str, dict]:
    """Per policy: accuracy, identical fraction, mean KL, KV fraction; also by length."""
    by = defaultdict(list)
    for r in rows:
        by[r["policy"]].append(r)

    def stats(rs):
        n = len(rs)
        return {
            "accuracy": sum(r["correct"] for r in rs) / n,
            "identical": sum(r["identical"] for r in rs) / n,
            "answer_identical": sum(r.get("answer_identical", r["identical"]) for r in rs) / n,
            "mean_kl": sum(r["kl"] for r in rs) / n,
            "kv_fraction": sum(r["kv_fraction"] for r in rs) / n,
            "n": n,
        }

    out = {}
    for name, rs in by.items():
        lengths = defaultdict(list)
        for r in rs:
            lengths[r["length_bucket"]].append(r)
        out[name] = stats(rs) | {"by_length": {k: stats(v) for k, v in sorted(lengths.items())}}
    return out


def meets_bar(s: dict, dense: dict, slack: float, identical_min: float) -> bool:
    """Dense's accuracy within `slack` and at least `identical_min` identical completions."""
    return s["accuracy"] >= dense["accuracy"] - slack and s["identical"] >= identical_min


def topk_label(budget: int) -> str:
    """The suite's top-k row of `budget` tokens."""
    return DecodePolicy("topk", FIRST.replace(topk_tokens=budget), budget).label


def best_topk(tab: dict, budgets: list[int], slack: float, identical_min: float, key=None):
    """The smallest top-k budget meeting dense's accuracy within `slack` and the identical
    fraction: `(label, stats)`, or None. `key` picks one length bucket's stats."""
    pick = (lambda s: s) if key is None else (lambda s: s.get("by_length", {}).get(key))
    dense = pick(tab["dense"])
    for b in sorted(budgets):
        label = topk_label(b)
        s = pick(tab.get(label, {}))
        if s and meets_bar(s, dense, slack, identical_min):
            return label, s
    return None


def summarize(tab: dict, budgets: list[int], slack: float, identical_min: float) -> dict:
    dense = tab["dense"]
    psa = tab.get(DecodePolicy("psa", PSAConfig()).label)
    if psa is None:  # a run of other policies (joined with the default's by --combine);
        # its keys are null in the result file (`dump_result`)
        keys = ("kv_fraction", "accuracy", "identical", "answer_identical", "mean_kl")
        psa = dict.fromkeys(keys, float("nan"))
    best = best_topk(tab, budgets, slack, identical_min)
    # The largest budget run, bar or not: where no budget meets the bar (the 1.5B model:
    # 8192 tokens lose an answer) the ratio to it says how far psa is from the nearest one.
    largest = tab.get(topk_label(max(budgets))) if budgets else None
    # Certified mode at 16K+: the certified policy reading least there (each guarantees
    # its own ε of every head's mass at every step).
    long_kv = {}
    for name, stats in tab.items():
        if name.startswith("psa-certified-"):
            long = [s for k, s in stats.get("by_length", {}).items() if k >= 16384]
            if long:
                long_kv[name] = sum(s["kv_fraction"] * s["n"] for s in long) / sum(
                    s["n"] for s in long
                )
    certified = min(long_kv, key=long_kv.get) if long_kv else None
    # The numerical floor: ε 1 reads every block (only the order of summation differs from
    # dense), so no sparse policy is expected to keep more completions identical.
    floor = tab.get(floor_policy().label)
    # The psa policy reading least at the bar (the candidate for the default).
    ok = sorted(
        (s["kv_fraction"], n)
        for n, s in tab.items()
        if n.startswith("psa-") and meets_bar(s, dense, slack, identical_min)
    )
    return {
        "kv_fraction_psa": psa["kv_fraction"],
        "kv_fraction_best_topk": best[1]["kv_fraction"] if best else None,
        "best_topk_policy": best[0] if best else None,
        "kv_ratio_psa_vs_best_topk": psa["kv_fraction"] / best[1]["kv_fraction"] if best else None,
        "kv_ratio_psa_vs_largest_topk": psa["kv_fraction"] / largest["kv_fraction"]
        if largest
        else None,
        "accuracy_delta_largest_topk_vs_dense": largest["accuracy"] - dense["accuracy"]
        if largest
        else None,
        "accuracy_delta_psa_vs_dense": psa["accuracy"] - dense["accuracy"],
        "identical_fraction_psa": psa["identical"],
        "answer_identical_fraction_psa": psa["answer_identical"],
        "mean_kl_psa": psa["mean_kl"],
        "kv_fraction_certified_16k": long_kv[certified] if certified else None,
        "certified_16k_policy": certified,
        "identical_fraction_floor": floor["identical"] if floor else None,
        "best_psa_policy": ok[0][1] if ok else None,
        "kv_fraction_best_psa": ok[0][0] if ok else None,
    }


def plot(tab: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, s in tab.items():
        if name == "dense":
            continue
        marker = "o" if name.startswith("topk") else "s"
        ax.plot(s["kv_fraction"], max(s["mean_kl"], 1e-6), marker)
        ax.annotate(name, (s["kv_fraction"], max(s["mean_kl"], 1e-6)), fontsize=6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("fraction of KV read (blocks + metadata)")
    ax.set_ylabel("mean next-token KL from dense")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(doc: dict) -> str:
    """A result's policies as a markdown table: the whole suite, then KV fraction and
    identical completions per length (the closing notes' and docs' table)."""
    tab = doc["data"]["policies"]
    lengths = sorted({int(k) for s in tab.values() for k in s["by_length"]})
    head = "| policy | accuracy | identical | answer id. | mean KL | KV read | " + " | ".join(
        f"{n // 1024 if n % 1024 == 0 else round(n / 1000)}K KV / id." for n in lengths
    )
    rows = [head + " |", "|---" * (6 + len(lengths)) + "|"]
    for name, s in tab.items():
        per = [s["by_length"].get(str(n)) or s["by_length"].get(n) for n in lengths]
        cells = [f"{p['kv_fraction']:.3f} / {p['identical']:.2f}" if p else "" for p in per]
        rows.append(
            f"| {name} | {s['accuracy']:.3f} | {s['identical']:.2f} | "
            f"{s.get('answer_identical', float('nan')):.2f} | {s['mean_kl']:.4f} | "
            f"{s['kv_fraction']:.3f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(rows) + "\n"


def combine(files: list[Path], out: Path, budgets: list[int], args) -> None:
    """One result from the rows of several runs of the suite (on the same machine kind):
    per policy and task the first file's row; policies that miss a task are dropped."""
    docs = [json.loads(f.read_text()) for f in files]
    rows, seen = [], set()
    for doc in docs:
        for r in doc["data"]["rows"]:
            key = (r["policy"], r["length_bucket"], r["task"], r.get("index"))
            if key not in seen:
                seen.add(key)
                rows.append(r)
    task = lambda r: (r["length_bucket"], r["task"], r.get("index"))  # noqa: E731
    every = {task(r) for r in rows if r["policy"] == "dense"}
    covered = defaultdict(set)
    for r in rows:
        covered[r["policy"]].add(task(r))
    dropped = sorted(p for p, ts in covered.items() if ts != every)
    rows = [r for r in rows if r["policy"] not in dropped]
    tab = table(rows)
    write_result(
        out.with_suffix(".json"),
        summarize(tab, budgets, args.accuracy_slack, args.identical_min),
        {"policies": tab, "rows": rows},
        machine=docs[0]["machine"],
        git_commit=commit_text(c for d in docs for c in commit_list(d["git_commit"])),
        model=docs[0].get("model"),
        lengths=sorted({r["length_bucket"] for r in rows}),
        budgets=budgets,
        sources=[
            {k: d.get(k) for k in ("command", "date", "git_commit", "machine")} | {"file": f.name}
            for f, d in zip(files, docs)
        ],
        dropped_policies=dropped,
    )
    plot(tab, out.with_suffix(".png"), f"{docs[0].get('model')}, {len(every)} tasks")
    print(report(json.loads(out.with_suffix(".json").read_text())), end="")
    print("dropped (not on every task):", dropped)


def attach(src: Path, dest: Path, suffix: str) -> dict:
    """Copy `src`'s summary keys, each with `suffix`, into `dest`'s summary (a second
    model's run beside the test model's: `--model qwen2.5-1.5b --name adaptive_budget_1p5b`,
    then `--attach` it with `_1p5b`), and record where they come from under `dest`'s
    `attached[suffix]` (file, model, date, commit, command). `dest` keeps its own data;
    the attached run's rows stay in `src`. Returns the keys written."""
    if not suffix.startswith("_"):
        raise SystemExit(f"--suffix {suffix!r}: a key suffix starts with '_' (say _1p5b)")
    got, doc = json.loads(src.read_text()), json.loads(dest.read_text())
    keys = {f"{k}{suffix}": v for k, v in got["summary"].items()}
    doc["summary"] = {**doc["summary"], **keys}
    doc.setdefault("attached", {})[suffix] = {
        "file": src.name,
        **{k: got.get(k) for k in ("model", "date", "git_commit", "command")},
    }
    dest.write_text(dump_result(doc))
    return keys


def commit_list(text: str) -> list[str]:
    """A result's `git_commit` ("a; b" where runs were joined) as its commits."""
    return [c for c in text.split("; ") if c]


def commit_text(commits) -> str:
    """`commits` as a result's `git_commit`: each once, in order."""
    return "; ".join(dict.fromkeys(commits))


def resumed(path: Path) -> tuple[list[dict], list[str]]:
    """An earlier run's rows and the commits that measured them: the run resuming it
    names those beside its own in `git_commit` (a resume may cross commits)."""
    doc = json.loads(path.read_text())
    rows = doc["data"]["rows"]
    return rows, commit_list(doc.get("git_commit", "")) if rows else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--lengths", default="4096,8192,16384,24576,32000")
    ap.add_argument("--per-kind", type=int, default=2, help="tasks per kind and length")
    ap.add_argument("--kinds", default=",".join(GENERATORS))
    ap.add_argument("--budgets", default="256,512,1024,2048,4096", help="top-k tokens")
    ap.add_argument("--accuracy-slack", type=float, default=0.01)
    ap.add_argument("--identical-min", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--reference",
        action="store_true",
        help="sparse policies through the PyTorch reference on a GPU too (default there: "
        "the Triton kernels: a few launches per policy and layer)",
    )
    ap.add_argument(
        "--policies",
        help="comma list of policy labels to run (default: all; dense always runs: the "
        "reference of the others; join runs with --combine)",
    )
    ap.add_argument("--name", default="adaptive_budget")
    ap.add_argument("--out", default=str(RESULTS), help="folder of NAME.json and NAME.png")
    ap.add_argument(
        "--merge",
        nargs="*",
        default=[],
        help="result files of earlier runs (other lengths) whose rows join this run's",
    )
    ap.add_argument(
        "--resume",
        help="a result file of an earlier run of the same suite (say this run's own "
        "NAME.json): its tasks are kept and not run again",
    )
    ap.add_argument(
        "--shard",
        metavar="K/N",
        help="run every N-th task of the suite from the K-th (N processes on one GPU, each "
        "with its own --name; join them with --combine)",
    )
    ap.add_argument("--report", metavar="NAME.json", help="print a result's table and exit")
    ap.add_argument(
        "--attach",
        metavar="FILE",
        help="no model: copy FILE's summary keys, each with --suffix, into OUT/NAME.json "
        "(a second model's run beside the test model's)",
    )
    ap.add_argument("--suffix", default="_1p5b", help="the key suffix of --attach")
    ap.add_argument(
        "--combine",
        nargs="+",
        metavar="FILE",
        help="no model: write NAME.json from these results' rows (the first file's row of "
        "a policy and task wins), keeping the policies run on every task dense ran",
    )
    args = ap.parse_args()
    try:
        shard([], args.shard)
    except ValueError as e:
        ap.error(str(e))
    if args.report:
        print(report(json.loads(Path(args.report).read_text())), end="")
        return
    if args.attach:
        keys = attach(Path(args.attach), Path(args.out) / f"{args.name}.json", args.suffix)
        print(json.dumps(keys, indent=1))
        return
    if args.combine:
        budgets = [int(b) for b in args.budgets.split(",")]
        combine([Path(f) for f in args.combine], Path(args.out) / args.name, budgets, args)
        return

    model, tok = load_model(ensure_model(args.model), device=args.device)
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])
    budgets = [int(b) for b in args.budgets.split(",")]
    kernels = args.device.startswith("cuda") and not args.reference
    pols = policies(budgets)
    if args.policies:
        want = set(args.policies.split(","))
        unknown = want - {p.label for p in pols}
        if unknown:
            raise SystemExit(
                f"--policies: unknown {sorted(unknown)}; known: {', '.join(p.label for p in pols)}"
            )
        pols = [p for p in pols if p.label in want | {"dense"}]  # dense first: the reference
    stop = stop_ids(tok)
    rows, merged, commits = [], [], []  # commits: those of the rows a resume keeps
    for f in args.merge:
        merged += json.loads(Path(f).read_text())["data"]["rows"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> dict:
        """The result so far (after every task: a run cut short keeps what finished)."""
        every = rows + merged
        tab = table(every)
        write_result(
            out / f"{args.name}.json",
            summarize(tab, budgets, args.accuracy_slack, args.identical_min),
            {"policies": tab, "rows": every},
            model=MODELS[args.model].name,
            lengths=sorted({r["length_bucket"] for r in every}),
            per_kind=args.per_kind,
            budgets=budgets,
            git_commit=commit_text([*commits, git_commit()]),
        )
        return tab

    # Task i of every kind at every length before task i + 1 of any: a run cut short
    # still covers every length. `--resume` skips what an earlier run finished.
    kinds = args.kinds.split(",")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    by_length = {n: make_tasks(kinds, n, args.per_kind, args.seed, count) for n in lengths}
    jobs = [
        (n, i, by_length[n][k * args.per_kind + i])
        for i in range(args.per_kind)
        for n in lengths
        for k in range(len(kinds))
    ]
    jobs = shard(jobs, args.shard)
    if args.resume and Path(args.resume).exists():
        earlier, commits = resumed(Path(args.resume))
        merged += earlier
        done = {(r["length_bucket"], r["task"], r.get("index")) for r in earlier}
        jobs = [j for j in jobs if (j[0], j[2].kind, j[1]) not in done]
        print(f"resuming {args.resume}: {len(earlier) // len(pols)} tasks done", flush=True)
    t0 = time.time()
    for done_jobs, (n, i, task) in enumerate(jobs, 1):
        doc, q = chat_parts(tok, task.prompt, task.question)
        session = Session(model, tok)
        session.extend(doc + q)
        got = run_task(session, task, pols, stop, kernels)
        for r in got:
            r["length_bucket"], r["index"] = n, i
        rows += got
        save()
        print(
            f"{n} tokens, {task.kind} #{i}: task {done_jobs}/{len(jobs)} done, "
            f"{time.time() - t0:.0f} s so far",
            flush=True,
        )
    tab = save()
    n_tasks = len(rows + merged) // len(pols)
    plot(tab, out / f"{args.name}.png", f"{args.model}, {n_tasks} tasks")
    for name, s in tab.items():
        print(
            f"{name:24s} acc {s['accuracy']:.3f} identical {s['identical']:.3f} "
            f"KL {s['mean_kl']:.4f} KV {s['kv_fraction']:.4f}"
        )
    print("summary:", json.loads((out / f"{args.name}.json").read_text())["summary"])


if __name__ == "__main__":
    main()
