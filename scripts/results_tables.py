"""Tables generated from `benchmark/results/*.json`, never typed by hand.

    python scripts/results_tables.py            # rewrite README's headline table and docs/results.md
    python scripts/results_tables.py --check    # exit 1 if either is out of date (CI runs this)

README.md holds the headline table between `<!-- results:begin -->` and
`<!-- results:end -->`; docs/results.md lists every result file README reads (and their
inputs) with its machine, date, command, summary and plot; `benchmark/results/archive/`
holds one-off studies and earlier runs, indexed one line each in its INDEX.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmark" / "results"
ARCHIVE = RESULTS / "archive"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

# (file, summary key, what it is, how to read it)
HEADLINE = [
    ("serving_h100", "decode_step_ratio_psa_vs_fastest_sglang0523",
     "decode step, `--sparse-mode psa` (the default: selection kept 8 steps) / plain SGLang "
     "(32 x 28K, decode CUDA graphs)", "lower is better"),
    ("serving_h100", "decode_step_ratio_topk_vs_fastest_sglang0523",
     "decode step, `--sparse-mode topk` (2048 tokens, the default) / plain (32 x 28K)",
     "lower is better"),
    ("serving_h100", "throughput_ratio_psa_vs_fastest_sglang0523",
     "output throughput, psa / plain (32 x 28K, 1024 outputs)", "higher is better"),
    ("serving_h100", "decode_step_ratio_psa_vs_fastest_a16_sglang0523",
     "decode step, psa / plain (32 x 16K, 256 outputs)", "lower is better"),
    ("serving_h100", "throughput_ratio_psa_vs_fastest_a16_sglang0523",
     "output throughput, psa / plain (32 x 16K, 256 outputs)", "higher is better"),
    ("serving_h100", "ttft_ratio_psa_vs_fastest_sglang0523",
     "mean time to first token, psa / plain (32 x 28K)", "lower is better"),
    ("serving_h100", "accuracy_delta_vs_fastest_sglang0523",
     "answers correct, psa minus plain (32 x 28K and 32 x 16K, same prompts)", "0 = same"),
    ("serving_h100", "throughput_ratio_topk_r8_vs_fastest",
     "output throughput, topk (default) / plain (32 x 28K, 1024 outputs)", "higher is better"),
    ("serving_h100", "identical_fraction_server_psa",
     "64-token completions identical to plain's, psa in the server (32 x 16K)", "1 = same"),
    ("serving_h100", "identical_fraction_server_plain_vs_plain",
     "the same, a second plain server's (batched greedy decoding is not bit-reproducible)",
     "1 = same"),
    ("serving_h200", "decode_step_ratio_psa_vs_fastest",
     "decode step, psa (the default: selection kept 8 steps) / plain (32 x 28K)",
     "lower is better"),
    ("serving_h200", "decode_step_ratio_psa_r1_vs_fastest",
     "decode step, psa ranked every step (`--psa-rerank-interval 1`) / plain (32 x 28K)",
     "lower is better"),
    ("serving_h200", "decode_step_ratio_topk_vs_fastest",
     "decode step, topk (the default: selection kept 8 steps) / plain (32 x 28K)",
     "lower is better"),
    ("serving_h200", "throughput_ratio_psa_vs_fastest",
     "output throughput, psa / plain (32 x 28K, 1024 outputs)", "higher is better"),
    ("serving_h200", "decode_step_ratio_psa_vs_fastest_a16",
     "decode step, psa / plain (32 x 16K, 256 outputs)", "lower is better"),
    ("serving_h200", "throughput_ratio_psa_vs_fastest_a16",
     "output throughput, psa / plain (32 x 16K, 256 outputs)", "higher is better"),
    ("serving_h200", "accuracy_delta_vs_fastest",
     "answers correct, psa minus plain (32 x 28K and 32 x 16K, same prompts)", "0 = same"),
    ("serving_h200", "throughput_ratio_tiered_vs_fastest_capped",
     "output throughput, `--psa-kv-home tiered` (with `--radix-cache-backend psa`) / plain, "
     "32 x 28K, 1024 outputs, HBM for KV capped to plain's 4 requests", "higher is better"),
    ("serving_h200", "throughput_ratio_tiered_vs_fastest_capped_short",
     "the same at 256 outputs", "higher is better"),
    ("serving_h100", "throughput_ratio_tiered_vs_hbm",
     "output throughput, `--psa-kv-home tiered` / HBM only, uncapped (32 x 28K, one run)",
     "higher is better"),
    ("serving_h200", "throughput_ratio_tiered_vs_fastest_shared",
     "output throughput, tiered home with `--radix-cache-backend psa` / plain: 10 shared "
     "16K documents, 120 questions at 16/s", "higher is better"),
    ("serving_h200", "throughput_ratio_tiered_vs_fastest_shared_capped",
     "the same, HBM for KV capped to plain's 2 requests (the documents 5x that)",
     "higher is better"),
    ("serving_h200", "throughput_ratio_tiered_vs_fastest_chat",
     "the same, multi-turn chat: 16 conversations of 5 turns, 16K-28K", "higher is better"),
    ("serving_h200", "throughput_ratio_tiered_vs_fastest_chat_capped",
     "the same chat, HBM for KV capped to plain's 3 requests", "higher is better"),
    ("serving_h100", "decode_step_ratio_topk_vs_plain_8b",
     "decode step, topk / plain at Llama-3.1-8B shapes (dummy weights)", "lower is better"),
    ("serving_h100", "max_concurrent_ratio_tiered_vs_plain_8b",
     "requests decoding at once, topk + tiered / plain, 8B shapes, HBM for KV capped to "
     "plain's 10 (dummy weights)", "higher is better"),
    ("serving_h100", "throughput_ratio_tiered_vs_plain_8b",
     "output throughput, the same 8B run", "higher is better"),
    ("adaptive_budget", "kv_fraction_psa",
     "KV read per decode step, default psa policy (70 tasks, 4K-32K, GPU test model)",
     "lower is better"),
    ("adaptive_budget", "identical_fraction_psa",
     "64-token completions identical to dense's, default psa policy", "1 = same"),
    ("adaptive_budget", "kv_ratio_psa_vs_best_topk",
     "KV read, psa / the best single top-k budget at dense's answers (8192 tokens: dense's "
     "accuracy, >= 0.9 identical)", "lower is better"),
    ("adaptive_budget", "kv_fraction_psa_1p5b",
     "KV read, default psa policy, Qwen2.5-Coder-1.5B (head dim 128; the same 70 tasks: "
     "dense's accuracy, answers identical 0.93, completions 0.34 where reading every block "
     "keeps 0.66)", "lower is better"),
    ("adaptive_budget", "kv_ratio_psa_vs_largest_topk_1p5b",
     "the same / top-k 8192 (no budget up to 8192 keeps dense's accuracy on this model: "
     "8192 loses 1.4 points)", "lower is better"),
    ("adaptive_budget", "kv_fraction_certified_16k",
     "KV read at 16K-32K, certified rule on 5-bit key codes (ε 0.9 of every head's mass "
     "guaranteed; codes counted; the suite's kernels)", "lower is better"),
    ("store_h100", "save_ratio_to_d2h_peak",
     "write-back to the host tier / D2H memcpy peak", "higher is better"),
    ("store_h100", "prefill_slowdown_with_save",
     "prefill time with write-back / without", "lower is better"),
    ("store_h100", "hbm_hit_rate",
     "tiered home, capped HBM: share of KV units decode read from HBM", "higher is better"),
    ("decode_step_h100", "syncs_per_step", "host syncs per decode step", "0 required"),
    ("decode_step_h100", "launches_per_layer_psa", "kernel launches per layer and step, psa", ""),
    ("reliability", "faults_survived", "faults survived (of `faults_tried`)", ""),
    ("reliability", "requests_lost", "requests lost under 500-request overload", ""),
    ("reliability", "leaked_pages_after_load", "KV pages held after aborts and load", ""),
    ("reliability", "bad_inputs_clean_error", "bad inputs answered or refused with a 4xx (of `bad_inputs_tried`)", ""),
    ("reliability", "soak_rss_growth_mb", "host RSS growth over the soak, MB", ""),
]  # fmt: skip


def _no_nan(token: str):
    raise ValueError(f"{token} is not JSON (write null for a value a run does not have)")


def read(path: Path) -> dict:
    """A result file, strictly: NaN and Infinity, which Python writes and other readers
    refuse, fail here naming the file."""
    try:
        return json.loads(path.read_text(), parse_constant=_no_nan)
    except ValueError as e:
        raise SystemExit(f"results_tables: {path}: {e}") from None


def load(name: str) -> dict:
    return read(RESULTS / f"{name}.json")


def fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):  # NaN: no row to summarise
        return "not measured"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) >= 0.01 or v == 0 else f"{v:.3g}"
    if isinstance(v, (list, dict)):
        return "`" + json.dumps(v)[:60] + "`"
    return str(v)


def device(doc: dict) -> str:
    m = str(doc.get("device") or doc.get("machine", "?"))
    for gpu in ("H100", "H200"):
        if gpu in m:
            return gpu
    return "CPU" if "no GPU" in m or "2 cpus" in m else m.split(",")[0]


def against(doc: dict, key: str) -> str:
    """The baseline a serving ratio is taken against: the fastest plain SGLang backend of
    its stage run (`*_vs_fastest`, named in `plain_backend*`), plain SGLang at triton
    (the other `*_vs_plain*` keys), or another sglang-psa system."""
    summary = doc.get("summary", {})
    # a stage on another SGLang release: the same keys suffixed `_sglang<digits>`
    base, _, tag = key.partition("_sglang")
    release = release_of(doc, key)
    sglang = f"SGLang {release}" if release else "SGLang"  # the release its stage ran
    if "_vs_fastest" in base:
        which = "_a16" if base.endswith("_a16") else "_8b" if base.endswith("_8b") else ""
        # the backend raced on the key's own release (a key without suffix may be an
        # older release's than the plain_backend key without suffix)
        tag = tag or (release or "").replace(".", "")
        backend = summary.get(f"plain_backend{which}_sglang{tag}") or summary.get(
            f"plain_backend{which}"
        )
        return f"{sglang} {backend.removeprefix('plain_')}" if backend else "not raced"
    if "vs_plain" in key or key.startswith("identical_fraction_server"):
        return f"{sglang} triton"  # identical completions: against plain triton's, same run
    if "_vs_hbm" in key:
        return "psa, HBM home"
    return ""


def release_of(doc: dict, key: str) -> str:
    """The SGLang release a summary key was measured on (its provenance), or ""."""
    where = (doc.get("summary_provenance") or {}).get(key) or {}
    return where.get("sglang") or next((r.get("sglang") for r in where.get("runs", [])), "")


def run_date(doc: dict, key: str) -> str:
    """The day of the run a summary key comes from (of its newest run where it pairs
    several, e.g. accuracy over two workloads); the file's date only for a key without
    provenance."""
    where = (doc.get("summary_provenance") or {}).get(key) or {}
    dates = [r.get("date") for r in where.get("runs", [])] + [where.get("date")]
    dates = [str(d) for d in dates if d]
    return (max(dates) if dates else str(doc.get("date", "?")))[:10]


def headline() -> str:
    rows = [
        "| measure | value | how to read | against | machine, run date | file |",
        "|---|---|---|---|---|---|",
    ]
    for name, key, what, read in HEADLINE:
        doc = load(name)
        when = f"{device(doc)}, {run_date(doc, key)}"
        val = fmt(doc["summary"].get(key))
        vs = against(doc, key) if name.startswith("serving_") else ""
        if name == "reliability" and doc["summary"].get("kv_home"):  # the server it tried
            what = f"{what}, server at the `{doc['summary']['kv_home']}` KV home"
        rows.append(f"| {what} | {val} | {read} | {vs} | {when} | `{name}.json` |")
    return "\n".join(rows) + "\n"


def serving_table(doc: dict) -> str:
    """The serving benchmark's own table (benchmark/serving/analysis.py)."""
    sys.path.insert(0, str(ROOT / "benchmark" / "serving"))
    import analysis

    return analysis.markdown_table(doc["data"])


def results_md() -> str:
    out = [
        "# Results",
        "",
        "Every file under `benchmark/results/` (the files README reads and their inputs), with",
        "its provenance, summary and plot. Generated by `python scripts/results_tables.py`; do",
        "not edit by hand. Ratios are against plain SGLang (or the hardware peak) measured in",
        "the same run. Studies and earlier runs: `benchmark/results/archive/INDEX.md`.",
        "",
    ]
    for path in sorted(RESULTS.glob("*.json")):
        doc = read(path)
        out += [f"## {path.stem}", ""]
        out.append(f"- machine: {doc.get('machine', '?')}")
        out.append(f"- date: {doc.get('date', '?')}")
        out.append(f"- command: `{doc.get('command', '?')}`")
        if path.with_suffix(".png").exists():
            out.append(f"- plot: [{path.stem}.png](../benchmark/results/{path.stem}.png)")
        summary = doc.get("summary")
        if isinstance(summary, dict) and summary:
            # several SGLang releases: a key without suffix is the newest release's that
            # measured it (analysis.summary_over_releases), so say which one
            several = ";" in str(doc.get("sglang", ""))
            if several:
                out += ["", "Keys suffixed `_sglang<digits>` hold each release's own values."]
            out += ["", "| key | value |" + (" SGLang |" if several else "")]
            out.append("|---|---|" + ("---|" if several else ""))
            for k, v in summary.items():
                out.append(
                    f"| `{k}` | {fmt(v)} |" + (f" {release_of(doc, k)} |" if several else "")
                )
        else:
            out += ["", "(no summary: raw data only)"]
        if path.stem.startswith("serving_"):
            out += ["", "Per workload and system (each stage's plain SGLang listed with it):", ""]
            out.append(serving_table(doc).rstrip())
        out.append("")
    return "\n".join(out)


def archive_index() -> str:
    """One line per archived result: what ran, where and when, and its plot."""
    out = [
        "# Archived results",
        "",
        "One-off studies and earlier runs, kept for their provenance; README reads none of",
        "them. Generated by `python scripts/results_tables.py`; do not edit by hand.",
        "",
    ]
    for path in sorted(ARCHIVE.glob("*.json")):
        doc = read(path)
        plot = f" [plot]({path.stem}.png)" if path.with_suffix(".png").exists() else ""
        when = str(doc.get("date", "?"))[:10]
        out.append(f"- `{path.name}`: {device(doc)}, {when}, `{doc.get('command', '?')}`{plot}")
    return "\n".join(out) + "\n"


def with_headline(readme: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"README.md lacks the {BEGIN} ... {END} markers")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{headline()}{END}{tail}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if a generated file is stale")
    args = ap.parse_args()
    readme_path, results_path = ROOT / "README.md", ROOT / "docs" / "results.md"
    want = {
        readme_path: with_headline(readme_path.read_text()),
        results_path: results_md(),
        ARCHIVE / "INDEX.md": archive_index(),
    }
    stale = [p for p, text in want.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is out of date: python scripts/results_tables.py")
        sys.exit(1 if stale else 0)
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(want[p])
        print(f"wrote {p.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
