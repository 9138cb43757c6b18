#!/usr/bin/env python3
"""The tests marked `gpu`, on the GPU machine, over back-to-back device calls: the whole
suite takes longer than one 10-minute call, so each call runs what the calls before it
left until its budget ends, and says where the suite stands: kernel and unit files
`--jobs` at once (they share the GPU well; compiling dominates; a file of more than
`--split-over` pending tests in up to three parts), then reliability and end-to-end files
(they start servers) one at a time, or `--server-jobs` at a time those whose servers cap
their memory (`SHARES`).

    python3 scripts/gpu_tests.py --budget-s $((560 - SECONDS)) --out $OUT

State lives in `--state` (default /tmp/psa-gpu-tests: outside the working tree, which
each device call replaces). Each test file's outcomes are keyed by what they depend on:
the product (`python`, `sgl-kernel-ext`, `pyproject.toml`), the helpers any test may use
(every file under `test/` that is not a `test_*.py`), `benchmark` and `examples` where the
file names them (the reliability tests load `benchmark/reliability/probes.py`), and the
file itself. A file whose key changed runs again; the others keep their outcomes, so a fix to
one test file reruns that file alone, while a product change reruns everything. `scripts/`
(the tools that stage and run the suite, this runner among them) enters no key.
`--seed-state` resumes a state another session's last call brought back
(`$OUT/gpu_tests_state.json`): a fresh machine goes on where the last one stopped, and a
call on some paths keeps the outcomes of files outside them for a later call. Each
test's outcome is read from pytest's `-v` lines as they stream and from the records of
every test phase its plugin (`scripts/gpu_tests_plugin.py`) writes as the phase ends,
with each failure's report, so a call cut short keeps what finished and why it failed.
The test running when the budget ends is run again by the next call; cut twice, it is
recorded `timeout`; one a finished pytest run never reached (its
module failed to import, pytest crashed) is an `error`. Files run kernels first, then unit,
reliability and end-to-end tests (the slow ones), each file's tests in one pytest run.

`--out/gpu_tests.json`: `{"git_commit", "collected", "counts": {outcome: n}, "pending",
"failed": {id: message}, "skipped": {id: reason}, "files": {file: {outcome: n,
"seconds"}}, "test_seconds": {id: its setup + call + teardown seconds, slowest first}}`,
and `--out/gpu_tests/<file>.log`, the last log of each file with a failure. A skipped
test is listed with its reason, never counted as passed. Exit status: 0 all ran and none
failed, 1 some failed (or errored, or timed out), 3 tests are still pending (run it again
in the next call).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "python"))

from sglang_psa.eval.results import package_versions, source_digest  # noqa: E402

ORDER = {"kernels": 0, "unit": 1, "reliability": 2, "e2e": 3}  # by test/<dir>
# A reliability or end-to-end file whose servers each cap their memory and KV pool
# (`--mem-fraction-static`, `--max-total-tokens`) says so with this line; with
# `--server-jobs` above 1 it runs beside another such file. Any other runs alone.
SHARES = re.compile(r"^SERVERS_SHARE_THE_GPU = True\b", re.M)
BAD = ("failed", "error", "timeout")
# a test id may hold spaces (a parameter's id): the outcome word ends it
LINE = re.compile(r"^(\S+::.+?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)(?: +(.*))?$")
SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+::.+?)(?: - (.*))?$")
WORST = ["passed", "xfail", "xpass", "skipped", "failed", "error"]  # a later one wins
PER_TEST_S = 300  # pytest-timeout's limit for one test


def collect(root: Path, paths: list[str], marker: str) -> tuple[list[str], dict[str, str]]:
    """The marked tests' ids, and each module that failed to collect with the error's last
    line (its tests' ids are unknown; the run records it as `<path>::<collection>`)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd + ["-m", marker, *paths], cwd=root, capture_output=True,
                          text=True)  # fmt: skip
    lines = proc.stdout.splitlines()
    ids = [line.strip() for line in lines if "::" in line and not line.startswith("ERROR")]
    errors = {}
    for i, line in enumerate(lines):
        if m := re.match(r"^_+ ERROR collecting (\S+) _+$", line):
            last = next((x for x in lines[i + 1 :] if x.startswith("E ")), "E   error")
            errors[m.group(1)] = last[1:].strip()
    if proc.returncode not in (0, 2, 5) or not (ids or errors):  # 2: collection errors
        raise SystemExit(
            f"gpu_tests: collecting failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    return ids, errors


# What every test file's outcome depends on besides itself (`source_digest`): code, not
# results, docs or caches; with the non-test files under test/ (conftest, stubs, helpers).
SHARED = ("python", "sgl-kernel-ext", "pyproject.toml")
# Folders of code only some tests run (benchmark/reliability's probes, say): a test reaches
# such code through a path it spells out (`"benchmark" / "reliability"`, benchmark/x.py).
# A file's key holds the code its paths name (`named_code`): the named entry of the folder
# (all of it where a path stops at the folder), with what that code names in turn.
NAMED = ("benchmark", "examples")
# Test folders whose files run in-process on what they import (no server, no subprocess):
# a file there is keyed on its import closure within SHARED's packages rather than on all
# of SHARED, so a serving-code change leaves the kernel tests' outcomes standing.
CLOSURE_DIRS = ("test/kernels",)
PACKAGE_ROOTS = ("python", "sgl-kernel-ext")
# A module that imports by name at run time could reach anything: a closure holding one
# falls back to the whole of SHARED.
DYNAMIC = ("import_module(", "__import__(", "entry_points(")
SOURCE_SUFFIXES = (".py", ".sh", ".toml", ".cfg", ".ini")
# The installed packages an outcome depends on beside this checkout's code: a state run on
# other versions of them runs every test again.
STACK = ("sglang", "torch", "triton")


def is_test_file(path: Path) -> bool:
    return path.name.startswith("test_") and path.suffix == ".py"


def _module_file(root: Path, name: str) -> Path | None:
    parts = name.split(".")
    for base in PACKAGE_ROOTS:
        stem = root.joinpath(base, *parts)
        for f in (stem.with_suffix(".py"), stem / "__init__.py"):
            if f.is_file():
                return f
    return None


def import_closure(root: Path, start: Path) -> set[Path] | None:
    """The files of SHARED's packages (`PACKAGE_ROOTS`) that `start` can import, with every
    enclosing package's `__init__.py`, found from the import statements anywhere in each
    file (a function-level import counts too); None when one of them imports by name at
    run time (`DYNAMIC`)."""
    seen: set[Path] = set()
    todo = [start]
    while todo:
        f = todo.pop()
        text = f.read_text(errors="replace")
        if f != start and any(d in text for d in DYNAMIC):
            return None
        names: set[str] = set()
        module = None
        for base in PACKAGE_ROOTS:
            if f.is_relative_to(root / base):
                rel = f.relative_to(root / base).with_suffix("")
                module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base_name = node.module or ""
                if node.level and module is not None:
                    pkg = module.split(".")
                    if f.name != "__init__.py":
                        pkg = pkg[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base_name = ".".join(pkg + ([node.module] if node.module else []))
                names.add(base_name)
                names.update(f"{base_name}.{a.name}" for a in node.names)  # a submodule?
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # the packages on the way are imported too
                g = _module_file(root, ".".join(parts[:i]))
                if g is not None and g not in seen:
                    seen.add(g)
                    todo.append(g)
    return seen


def named_refs(root: Path, text: str) -> set[str]:
    """The entries of `NAMED` folders that the paths spelled in `text` reach: "benchmark/x"
    for `"benchmark" / "x"`, `'benchmark', 'x'` or benchmark/x; the whole folder for a path
    that stops at it or names no entry of it. Prose ("the benchmark's") does not count."""
    refs: set[str] = set()
    for d in NAMED:
        for m in re.finditer(rf"(?<![\w.-]){re.escape(d)}\b", text):
            before = text[m.start() - 1] if m.start() else ""
            after = text[m.end() : m.end() + 200]
            if before in ("'", '"') and after.startswith(before):
                entry = re.match(r"""\s*[/,]\s*["']([\w.-]+)""", after[1:])
            elif after.startswith("/"):
                entry = re.match(r"/([\w.-]+)", after)
            else:
                continue
            name = entry.group(1) if entry else None
            refs.add(f"{d}/{name}" if name and (root / d / name).exists() else d)
    return refs


def named_code(root: Path, refs: set[str]) -> list[str]:
    """`refs` with what their code names in turn (`named_refs` of each source file, and a
    sibling of the same folder named by a quoted name: `parents[1] / "kernels"`), sorted;
    the whole folder stands for its entries."""
    seen: set[str] = set()
    todo = list(refs)
    while todo:
        ref = todo.pop()
        if ref in seen:
            continue
        seen.add(ref)
        top = ref.split("/")[0]
        siblings = {p.name for p in (root / top).iterdir()} if (root / top).is_dir() else set()
        path = root / ref
        for f in [path] if path.is_file() else sorted(path.rglob("*")):
            if not f.is_file() or f.suffix not in SOURCE_SUFFIXES or "__pycache__" in f.parts:
                continue
            text = f.read_text(errors="replace")
            todo += named_refs(root, text) - seen
            todo += [f"{top}/{n}" for n in re.findall(r"""["']([\w.-]+)["']""", text)
                     if n in siblings and f"{top}/{n}" not in seen]  # fmt: skip
    whole = {r for r in seen if "/" not in r}
    return sorted(r for r in seen if r in whole or r.split("/")[0] not in whole)


def file_keys(root: Path, paths: list[str]) -> tuple[str, dict[str, str]]:
    """(the shared sources' digest, {test file under `paths`: its key}): a key is the
    shared digest with the digest of the `NAMED` code it spells paths to and the file's own
    bytes."""
    helpers = [
        f
        for f in (root / "test").rglob("*")
        if f.is_file() and f.suffix in SOURCE_SUFFIXES and not is_test_file(f)
        and "__pycache__" not in f.parts
    ]  # fmt: skip
    rel = tuple(f.relative_to(root).as_posix() for f in helpers)
    shared = source_digest(root, SHARED + rel, SOURCE_SUFFIXES)
    always = set().union(*(named_refs(root, f.read_text(errors="replace")) for f in helpers))
    files = sorted(
        f for p in paths
        for f in ([root / p] if (root / p).is_file() else (root / p).rglob("test_*.py"))
        if is_test_file(f) and "__pycache__" not in f.parts
    )  # fmt: skip
    helper_digest = source_digest(root, ("pyproject.toml",) + rel, SOURCE_SUFFIXES)
    keys = {}
    for f in files:
        text = f.read_bytes()
        base = shared
        if any(f.is_relative_to(root / d) for d in CLOSURE_DIRS):
            confs = [c for c in (root / "test").rglob("conftest.py") if f.is_relative_to(c.parent)]
            closures = [import_closure(root, g) for g in [f, *confs]]
            if all(c is not None for c in closures):
                closure = set().union(*closures)
                names = tuple(sorted(g.relative_to(root).as_posix() for g in closure))
                base = helper_digest + source_digest(root, names, SOURCE_SUFFIXES)
        named = named_code(root, always | named_refs(root, text.decode(errors="replace")))
        parts = [base] + ([source_digest(root, tuple(named), SOURCE_SUFFIXES)] if named else [])
        keys[f.relative_to(root).as_posix()] = hashlib.sha256(
            ("".join(parts) + hashlib.sha256(text).hexdigest()).encode()
        ).hexdigest()
    return shared, keys


def file_order(test_id: str) -> tuple:
    path = test_id.split("::")[0]
    parts = Path(path).parts
    return (ORDER.get(parts[1] if len(parts) > 2 else "", 9), path)


def record(outcomes: dict[str, str], test_id: str, out: str) -> None:
    """`out` for `test_id` unless a worse outcome is already recorded (`WORST`)."""
    prev = outcomes.get(test_id)
    if prev not in WORST or WORST.index(out) >= WORST.index(prev):
        outcomes[test_id] = out


def phase_outcomes(records: list[dict]) -> dict[str, tuple[str, str | None]]:
    """{test id: (outcome, skip reason)} of the plugin's phase records: a failed call is
    `failed`, a failed setup or teardown `error`, a skip `skipped`, a passing call
    `passed` (a passing setup or teardown says nothing: the run may have been cut
    between them), xfail marks as pytest reports them."""
    outs: dict[str, str] = {}
    reasons: dict[str, str | None] = {}
    for r in records:
        out = r["outcome"]
        if r.get("xfail"):
            out = "xfail" if out == "skipped" else "xpass"
        elif out == "failed":
            out = "failed" if r["when"] == "call" else "error"
        elif out == "passed" and r["when"] != "call":
            continue
        record(outs, r["id"], out)
        reasons.setdefault(r["id"], r.get("reason"))
    return {t: (out, reasons[t]) for t, out in outs.items()}


def run_file(
    root: Path, ids: list[str], marker: str, deadline: float, log: Path, state: dict
) -> bool:
    """Run `ids` (one file's pending tests) in one pytest process until they end or
    `deadline`; outcomes and failure messages into `state`. True when it ran to its end."""
    # --capture=sys: what child processes write (an in-process engine's scheduler, whose
    # death takes pytest with it: SGLang kills its parent) reaches the log, not a lost file
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfE",
           "--tb=short", "--capture=sys", f"--timeout={PER_TEST_S}", "-p", "gpu_tests_plugin",
           "-m", marker, *ids]  # fmt: skip
    failures, phases = log.with_suffix(".failures.jsonl"), log.with_suffix(".phases.jsonl")
    failures.unlink(missing_ok=True)
    phases.unlink(missing_ok=True)
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    # COLUMNS: pytest cuts summary lines at the terminal width
    env = {**os.environ, "COLUMNS": "1000", "PYTHONPATH": path,
           "GPU_TESTS_FAILURES": str(failures), "GPU_TESTS_PHASES": str(phases)}  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)  # fmt: skip
    done, cut = threading.Event(), threading.Event()

    def watchdog():  # the budget's end kills the run and whatever it started
        if not done.wait(max(0.0, deadline - time.time())):
            cut.set()
            kill_tree(proc.pid)

    threading.Thread(target=watchdog, daemon=True).start()
    outcomes, messages = state["outcomes"], state["messages"]
    with log.open("w") as f:
        for line in proc.stdout:
            f.write(line)
            line = line.rstrip()
            if m := LINE.match(line):
                test_id, out, rest = m.group(1), m.group(2).lower(), m.group(3) or ""
                record(outcomes, test_id, out)
                if out == "skipped":
                    messages[test_id] = re.sub(r"\s*\[\s*\d+%\]$", "", rest).strip(" ()")
            elif m := SUMMARY.match(line):
                messages[m.group(2)] = (m.group(3) or m.group(1)).strip()
    proc.wait()
    done.set()
    records = [json.loads(x) for x in phases.read_text().splitlines()] if phases.exists() else []
    for test_id, (out, reason) in phase_outcomes(records).items():
        record(outcomes, test_id, out)
        if out == "skipped" and reason:
            messages.setdefault(test_id, reason)
    run_seconds: dict[str, float] = {}  # this run's phases of each test (a rerun replaces)
    for rec in records:
        run_seconds[rec["id"]] = run_seconds.get(rec["id"], 0.0) + rec["s"]
    state.setdefault("test_seconds", {}).update(run_seconds)
    for rec in map(json.loads, failures.read_text().splitlines() if failures.exists() else []):
        messages.setdefault(rec["id"], rec["message"])  # pytest's summary line, if any, first
        if outcomes.get(rec["id"]) not in BAD:  # failed in teardown after a PASSED line
            outcomes[rec["id"]] = "error" if rec["when"] != "call" else "failed"
    return not cut.is_set()


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`, its process group and every process descended from it, servers a
    test started in sessions of their own included (else they would hold the GPU into the
    next call)."""
    parent: dict[int, int] = {}
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit():  # the field after the ")" of the name: state, then ppid
                parent[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, grew = {pid}, True
    while grew:
        more = {c for c, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    for p in sorted(tree, reverse=True):
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def report(state: dict, ids: list[str], out: Path | None) -> tuple[dict, int]:
    outcomes, messages = state["outcomes"], state["messages"]
    counts: dict[str, int] = {}
    files: dict[str, dict] = {}
    for test_id in ids:
        o = outcomes.get(test_id, "pending")
        counts[o] = counts.get(o, 0) + 1
        f = files.setdefault(test_id.split("::")[0], {})
        f[o] = f.get(o, 0) + 1
    for name, secs in state["seconds"].items():
        if name in files:
            files[name]["seconds"] = round(secs, 1)
    doc = {
        "git_commit": state["commits"][-1],  # this call's; every call's in `git_commits`
        "git_commits": state["commits"],
        "versions": state.get("versions", {}),  # SGLang, torch and triton it ran on
        "shared_sha256": state["shared"],  # with each file's bytes, its key (`file_keys`)
        "collected": len(ids),
        "counts": counts,
        "pending": counts.get("pending", 0),
        "failed": {t: messages.get(t, o) for t in ids if (o := outcomes.get(t)) in BAD},
        "skipped": {t: messages.get(t, "") for t in ids if outcomes.get(t) == "skipped"},
        "files": files,
        # where the suite's time goes: each test's setup + call + teardown, slowest first
        "test_seconds": dict(sorted(
            ((t, round(s, 1)) for t, s in state.get("test_seconds", {}).items() if t in ids),
            key=lambda kv: -kv[1])),
    }  # fmt: skip
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_tests.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / "gpu_tests_state.json").write_text(json.dumps(state))  # --seed-state next time
    code = 1 if doc["failed"] else 3 if doc["pending"] else 0
    return doc, code


def dry_run(state: dict, keys: dict[str, str]) -> int:
    """Print, per test file under the paths, the outcomes the state keeps for it (its key
    unchanged) or that it runs again; nothing runs. The check before spending device time:
    a product change since the state's run voids every server test's outcome."""
    kept: dict[str, dict[str, int]] = {}
    for test_id, out in state["outcomes"].items():
        f = test_id.split("::")[0]
        kept.setdefault(f, {})
        kept[f][out] = kept[f].get(out, 0) + 1
    changed = sorted(f for f in keys if keys[f] != state["keys"].get(f))
    print(f"gpu_tests --dry-run: state of {state.get('versions')} at {state.get('commits')}")
    for f in sorted(keys):
        if f in changed:
            lost = kept.get(f)
            print(f"  {f}: runs again" + (f" (its outcomes {lost} are void)" if lost else ""))
        elif f in kept:
            print(f"  {f}: kept {kept[f]}")
    void = sum(n for f in changed for o, n in kept.get(f, {}).items() if o == "passed")
    print(f"{len(changed)} of {len(keys)} files changed; {void} passed outcome(s) void")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", default=["test"], help="test paths (test)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="this call's seconds")
    ap.add_argument("--state", default="/tmp/psa-gpu-tests")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="where results go ($OUT)")
    ap.add_argument("--marker", default="gpu")
    ap.add_argument("--min-left-s", type=float, default=20.0, help="no file starts with less")
    ap.add_argument("--jobs", type=int, default=6, help="kernel and unit files run at once")
    ap.add_argument("--server-jobs", type=int, default=1, help="server files that declare "
                    "SERVERS_SHARE_THE_GPU run this many at once (the others alone)")  # fmt: skip
    ap.add_argument("--split-over", type=int, default=30, metavar="N", help="a kernel or "
                    "unit file of more than N pending tests runs in 2-3 processes at once")  # fmt: skip
    ap.add_argument("--root", default=str(REPO), help="where pytest runs (this checkout)")
    ap.add_argument("--seed-state", help="an earlier call's $OUT/gpu_tests_state.json (another "
                    "session's): resumed where --state has none, each unchanged file's outcomes kept")  # fmt: skip
    ap.add_argument("--first", action="append", default=[], metavar="PATH",
                    help="run the pending test files under PATH before the rest, one at a "
                    "time (repeatable): what a call with little device time should see")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="say which files keep their "
                    "outcomes and which run again (from --state or --seed-state); run nothing")  # fmt: skip
    ap.add_argument("--rerun-failed", action="store_true", help="run the failed, errored and "
                    "timed-out tests of unchanged files again (a failure to see again)")  # fmt: skip
    args = ap.parse_args(argv)
    deadline = time.time() + args.budget_s
    commit = os.environ.get("GIT_COMMIT", "unknown")
    root = Path(args.root)
    shared, keys = file_keys(root, args.paths)
    state_dir = Path(args.state)
    state_file = state_dir / "state.json"
    seed = Path(args.seed_state) if args.seed_state else None
    from_file = state_file if state_file.exists() else seed if seed and seed.exists() else None
    state = json.loads(from_file.read_text()) if from_file else None
    if state is None or "keys" not in state:
        state = {"keys": {}, "commits": [], "paths": args.paths, "ids": None,
                 "outcomes": {}, "messages": {}, "cuts": {}, "seconds": {}}  # fmt: skip
    if state.get("paths") != args.paths:  # other paths: collect again, keep every file's
        state["paths"], state["ids"] = args.paths, None  # outcomes while its key holds
    if args.dry_run:
        return dry_run(state, keys)
    versions = package_versions(STACK)
    if state.get("versions", versions) != versions:  # another SGLang / torch / triton: all again
        print(f"gpu_tests: the state was run on {state['versions']}, this machine has "
              f"{versions}: every test runs again", flush=True)  # fmt: skip
        for table in ("keys", "outcomes", "messages", "cuts", "seconds", "test_seconds"):
            state[table] = {}
    state["versions"] = versions
    # a file outside `paths` keeps its outcomes for a later call that names it again
    changed = {f for f in keys if keys[f] != state["keys"].get(f)}
    kept = len(set(keys) - changed)
    if from_file == seed and state["outcomes"]:
        print(f"gpu_tests: resuming the state of {seed}: {kept} test file(s) unchanged, "
              f"{len(changed)} changed", flush=True)  # fmt: skip
    if changed:  # those files' outcomes go; collect again (their tests may differ)
        for table in ("outcomes", "messages", "cuts", "seconds", "test_seconds"):
            state[table] = {k: v for k, v in state.get(table, {}).items()
                            if k.split("::")[0] not in changed}  # fmt: skip
        state["keys"], state["ids"] = {**state["keys"], **keys}, None
        if not state["outcomes"]:  # nothing kept: the commits that ran it go too
            state["commits"] = []
    if args.rerun_failed:
        bad = [t for t, o in state["outcomes"].items() if o in BAD and "<collection>" not in t]
        for t in bad:
            for table in ("outcomes", "messages", "cuts"):
                state[table].pop(t, None)
        print(f"gpu_tests: running {len(bad)} failed test(s) again", flush=True)
    state["shared"] = shared
    if commit not in state["commits"]:
        state["commits"].append(commit)
    if state["ids"] is None:
        ids, errors = collect(root, args.paths, args.marker)
        for path, message in errors.items():
            ids.append(f"{path}::<collection>")
            state["outcomes"][ids[-1]] = "error"
            state["messages"][ids[-1]] = message
        state["ids"] = ids
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    ids = state["ids"]
    out = Path(args.out) if args.out else None
    by_file: dict[str, list[str]] = {}
    for test_id in sorted(ids, key=file_order):
        by_file.setdefault(test_id.split("::")[0], []).append(test_id)

    def run_one(name: str, pending: list[str], part: str = "") -> tuple | None:
        """Run one file's pending tests (or a `part` of them); None when too little of the
        budget is left."""
        if deadline - time.time() < args.min_left_s:
            return None
        log = state_dir / "logs" / (name.replace("/", "__") + part + ".log")
        print(f"gpu_tests: {name}{part}: {len(pending)} test(s)", flush=True)
        t0 = time.time()
        ended = run_file(root, pending, args.marker, deadline, log, state)
        return name, pending, ended, time.time() - t0, log

    def settle(name: str, pending: list[str], ended: bool, secs: float, log: Path) -> None:
        state["seconds"][name] = state["seconds"].get(name, 0.0) + secs
        if not ended:
            stuck = next((t for t in pending if t not in state["outcomes"]), None)
            if stuck is not None:
                state["cuts"][stuck] = state["cuts"].get(stuck, 0) + 1
                if state["cuts"][stuck] >= 2:
                    state["outcomes"][stuck] = "timeout"
                    state["messages"][stuck] = "cut by the call's budget twice"
        else:  # pytest ended, yet some never ran (a module that fails to import, a crash)
            for t in pending:
                if t not in state["outcomes"]:
                    state["outcomes"][t] = "error"
                    state["messages"][t] = f"pytest ended without running it (see {log.name})"
        if out is not None and any(state["outcomes"].get(t) in BAD for t in by_file[name]):
            (out / "gpu_tests").mkdir(parents=True, exist_ok=True)
            for f in (log, log.with_suffix(".failures.jsonl")):
                if f.exists():
                    (out / "gpu_tests" / f.name).write_text(f.read_text())
        state_file.write_text(json.dumps(state))

    work = [(n, [t for t in ids_ if t not in state["outcomes"]]) for n, ids_ in by_file.items()]
    work = [(n, pending) for n, pending in work if pending]
    # kernel and unit files share the GPU well (compiling dominates): --jobs at once; the
    # reliability and end-to-end files start servers: one at a time
    first: list[tuple[str, list[str]]] = []  # in --first's order, each file once
    for p in args.first:
        first += [w for w in work if w[0].startswith(p.rstrip("/")) and w not in first]
    work = [w for w in work if w not in first]
    shared = [w for w in work if file_order(w[0])[0] < ORDER["reliability"]]
    alone = [w for w in work if w not in shared]
    # a kernel or unit file of many tests runs in up to three pytest processes side by side
    # (every third test each: a file's parametrizations of one shape stay spread), the
    # longest first, so that the files run together end together
    split: list[tuple[str, list[str], str]] = []
    for name, pending in sorted(shared, key=lambda w: -len(w[1])):
        k = min(3, -(-len(pending) // max(1, args.split_over)))
        parts = [(name, pending[i::k], f".{i + 1}" if k > 1 else "") for i in range(k)]
        split += [w for w in parts if w[1]]

    def in_turn(files: list[tuple[str, list[str]]]) -> bool:
        """Run `files` one at a time; False once one is cut or the budget is spent."""
        for name, pending in files:
            if (result := run_one(name, pending)) is None:
                return False
            settle(*result)
            if not result[2]:
                return False
        return True

    def at_once(files: list[tuple], jobs: int) -> bool:
        """Run `files` `jobs` at a time; False once one is cut or the budget is spent."""
        ended = True
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            for f in as_completed([pool.submit(run_one, *w) for w in files]):
                if (result := f.result()) is None:
                    ended = False
                    continue
                settle(*result)
                ended &= result[2]
        return ended

    all_ended = in_turn(first) and at_once(split, args.jobs)
    # server files that declare their servers fit beside another's (`SHARES`) run
    # --server-jobs at a time, the one of most tests first; the others alone, after them
    sharing = sorted(
        (w for w in alone if SHARES.search((root / w[0]).read_text(errors="replace"))),
        key=lambda w: -len(w[1]),
    )
    if all_ended and args.server_jobs > 1 and sharing:
        all_ended = at_once(sharing, args.server_jobs)
        alone = [w for w in alone if w not in sharing]
    if all_ended:
        in_turn(alone)
    state_file.write_text(json.dumps(state))
    doc, code = report(state, ids, out)
    print(json.dumps({k: doc[k] for k in ("counts", "pending", "failed")}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
