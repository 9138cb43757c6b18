"""Bad inputs and faults thrown at a live `--sparse-mode psa` server, each with its outcome.

A probe sends something hostile (a malformed body, an impossible request, an abort at an
awkward moment, a flood) and returns an `Outcome`: what was expected, what came back, and
whether that is acceptable. Acceptable means the correct answer or a clear HTTP 4xx with a
message, the server still healthy afterwards, and (after the fault probes) every request
slot, KV page and admission entry free again, read from `/get_server_info`.

Used by `test/reliability/test_server_gpu.py` (asserts every outcome) and
`benchmark/reliability/run.py` (records them, plus the soak, in `reliability.json`).
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "psa-reliability-key"
MAX_RUNNING = 8
# The server both the test and the benchmark probe: KV capped at 40K tokens and 8 running
# requests, so queueing, working-set admission and retraction all happen.
SERVER_ARGS = [
    "--api-key", API_KEY, "--enable-metrics", "--context-length", "32768",
    "--max-total-tokens", "40000", "--max-running-requests", str(MAX_RUNNING),
    "--cuda-graph-max-bs-decode", str(MAX_RUNNING), "--mem-fraction-static", "0.3",
]  # fmt: skip
TOKEN = 1000  # a plain token id: prompts are built from ids, so lengths are exact
# The probes' model's KV per token (Qwen2.5-Coder-0.5B: 24 layers, 2 KV heads of 64, bf16)
KV_BYTES_PER_TOKEN = 24 * 2 * 2 * 64 * 2
# The same server at the tiered home, SGLang's radix cache over the host tier as that
# home starts by default (`--kv-home tiered` in the benchmark; the GPU test runs both homes).
TIERED_ARGS = ["--psa-kv-home", "tiered", "--psa-host-pool-gb", "4"]
KV_HOMES = {"hbm": [], "tiered": TIERED_ARGS}
# The tiered home spills a decoding request's KV to its host tier instead of retracting it,
# so nothing the probes send makes that server retract; there SGLang's own test switch
# retracts a decoding request every RETRACT_EVERY forward passes (the longest-running
# request always stays), so the faults and the soak meet retraction at both homes.
RETRACT_EVERY = 40
KV_HOME_ENV = {
    "hbm": {},
    "tiered": {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": str(RETRACT_EVERY)},
}


@contextlib.contextmanager
def live_server(
    args: list[str],
    port: int,
    log: Path,
    api_key: str | None = None,
    prefill: str | None = "triton",
    env: dict[str, str] | None = None,
):
    """A `--sparse-mode psa` server on the GPU test model with `args`, healthy: yields
    (`Server`, its process) and stops it afterwards (its log tail printed if it did not
    stop cleanly). A server that exits before it is healthy raises `SystemExit`. The
    server prefills on `prefill` (`--attention-backend`) unless `args` name a backend;
    None: the plugin's default (SGLang's fastest on the machine). `env`: variables set
    for the server over this process's environment."""
    with live_servers([(args, port, log)], api_key, prefill, env) as [(s, proc)]:
        yield s, proc


BACKEND_FLAGS = ("--attention-backend", "--prefill-attention-backend")


@contextlib.contextmanager
def live_servers(
    specs: list[tuple[list[str], int, Path]],
    api_key: str | None = None,
    prefill: str | None = "triton",
    env: dict[str, str] | None = None,
):
    """`live_server` for several (args, port, log) at once: every server is launched
    before the first is waited for (their start-ups overlap); yields [(`Server`, process)]
    in order and stops them all afterwards."""
    from sglang_psa import serve_demo
    from sglang_psa.models import ensure_model

    model = ensure_model("qwen2.5-0.5b")
    procs = []
    try:
        for args, port, log in specs:
            if prefill and not any(a in BACKEND_FLAGS for a in args):
                args = ["--attention-backend", prefill, *args]
            procs.append((serve_demo.launch(model, port, args, log, env), port, log))
        out = []
        for proc, port, log in procs:
            url = f"http://127.0.0.1:{port}"
            serve_demo.wait_healthy(proc, url, log, timeout=900)
            out.append((Server(url, api_key), proc))
        yield out
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc, _, log in procs:
            proc.wait(60)
            if proc.returncode not in (0, -15):
                print(log.read_text()[-5000:])


@dataclass
class Outcome:
    name: str
    kind: str  # "bad_input" | "fault" | "check" (not a fault: /metrics)
    expected: str
    got: str
    ok: bool
    detail: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


class Server:
    """A client for one server: its URL, API key and limits (read once from server info)."""

    def __init__(self, url: str, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.api_key = api_key
        info = self.info()
        self.context_length = int(info.get("context_length") or info["max_req_input_len"])
        self.max_total_tokens = int(info["internal_states"][0]["psa"]["kv_total_tokens"])
        self.idle = self.psa_state()

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, body=None, *, data=None, headers=None, **kw):
        h = self.headers if headers is None else headers
        return requests.post(self.url + path, json=body, data=data, headers=h, **kw)

    def info(self) -> dict:
        r = requests.get(self.url + "/server_info", headers=self.headers, timeout=60)
        r.raise_for_status()
        return r.json()

    def psa_state(self) -> dict:
        return self.info()["internal_states"][0]["psa"]

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=60).status_code == 200
        except requests.RequestException:
            return False

    def generate(self, ids: list[int], max_new: int, rid: str | None = None, timeout=900):
        sp = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": ids, "sampling_params": sp}
        if rid is not None:
            body["rid"] = rid
        return self.post("/generate", body, timeout=timeout)

    def abort(self, rid: str | None = None) -> int:
        body = {"abort_all": True} if rid is None else {"rid": rid}
        return self.post("/abort_request", body, timeout=60).status_code

    def settled(self) -> tuple[dict, dict, dict]:
        """After a load: (the counters, once the device counters were copied to the host,
        which asking for server info does; what is still held, `leaks`; the counters once
        nothing runs)."""
        self.psa_state()
        time.sleep(1)
        st = self.psa_state()
        held = self.leaks()
        return st, held, self.psa_state()

    def leaks(self, timeout: float = 120) -> dict:
        """Wait until nothing runs; what is still held then compared with the idle server
        (all zero when nothing leaked)."""
        deadline = time.time() + timeout
        while True:
            st = self.psa_state()
            held = {
                "running": st["running"],
                "paused": st["paused"],
                "kv_held_tokens": st["kv_held_tokens"],
                "req_slots_held": self.idle["req_slots_free"] - st["req_slots_free"],
            }
            if not any(held.values()) or time.time() > deadline:
                return held
            time.sleep(1)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [TOKEN + rng.randrange(20000) for _ in range(n)]


def _clear_4xx(r: requests.Response) -> bool:
    return 400 <= r.status_code < 500 and len(r.text.strip()) > 0


def _answer_or_4xx(r: requests.Response, answer_ok: Callable[[dict], bool]) -> bool:
    if r.status_code == 200:
        try:
            return answer_ok(r.json())
        except ValueError:
            return False
    return _clear_4xx(r)


# --- bad inputs --------------------------------------------------------------------


def bad_inputs(s: Server) -> list[Outcome]:
    out: list[Outcome] = []

    def probe(name, expected, send, ok):
        try:
            r = send()
            good = ok(r) and s.healthy()
            try:
                body = r.text.strip()[:200]
            except RuntimeError:  # a stream `ok` has read already
                body = "(streamed)"
            out.append(Outcome(name, "bad_input", expected, f"HTTP {r.status_code}: {body}", good))
        except Exception as e:  # noqa: BLE001 - every failure is an outcome
            out.append(Outcome(name, "bad_input", expected, f"{type(e).__name__}: {e}", False))

    gen = {"sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    comp = {"model": "default", "prompt": "The capital of France is", "max_tokens": 8}
    probe("empty prompt", "an answer or 4xx",
          lambda: s.post("/generate", {"text": "", **gen}, timeout=300),
          lambda r: _answer_or_4xx(r, lambda j: "text" in j))  # fmt: skip
    probe("prompt longer than --context-length", "4xx",
          lambda: s.generate(prompt(s.context_length + 256), 8), _clear_4xx)  # fmt: skip
    store = s.max_total_tokens + 1024
    if store < s.context_length:
        probe("prompt larger than the KV store holds", "4xx",
              lambda: s.generate(prompt(store), 8), _clear_4xx)  # fmt: skip
    probe("malformed JSON", "4xx",
          lambda: s.post("/v1/completions", data=b'{"prompt": "x", ', timeout=60,
                         headers={**s.headers, "Content-Type": "application/json"}),
          _clear_4xx)  # fmt: skip
    for name, params in (
        ("negative temperature", {"temperature": -1.0}),
        ("top_p above 1", {"top_p": 1.5}),
        ("negative max_tokens", {"max_tokens": -5}),
        ("unknown stop type", {"stop": 17}),
    ):
        probe(name, "4xx", lambda p=params: s.post("/v1/completions", {**comp, **p}, timeout=300),
              _clear_4xx)  # fmt: skip
    for name, params in (  # refused by SGLang's request model or SamplingParams.verify
        ("no prompt", {"prompt": None}),
        ("temperature as a string", {"temperature": "hot"}),
        ("max_tokens 0", {"max_tokens": 0}),
        ("n as a string", {"n": "two"}),
        ("top_k -5", {"top_k": -5}),
        ("frequency_penalty 5", {"frequency_penalty": 5.0}),
        ("presence_penalty -3", {"presence_penalty": -3.0}),
        ("min_p 2", {"min_p": 2.0}),
        ("repetition_penalty 0", {"repetition_penalty": 0.0}),
        ("top_p 0", {"top_p": 0.0}),
    ):
        body = {k: v for k, v in {**comp, **params}.items() if v is not None}
        probe(name, "4xx", lambda b=body: s.post("/v1/completions", b, timeout=300), _clear_4xx)
    chat = {"model": "default", "max_tokens": 8}
    for name, messages in (
        ("chat message of an unknown role", [{"role": "wizard", "content": "hi"}]),
        ("chat messages as a string", "hi"),
        ("chat message without content", [{"role": "user"}]),
    ):
        probe(name, "4xx", lambda m=messages: s.post(
            "/v1/chat/completions", {**chat, "messages": m}, timeout=300), _clear_4xx)  # fmt: skip
    for name, ids in (
        ("negative token id", [-3, 5, 7]),  # sglang-psa's check (SGLang 0.5.17 has none)
        ("token id past the vocabulary", [5, 10**9]),
    ):
        probe(name, "4xx", lambda i=ids: s.post(
            "/generate", {"input_ids": i, **gen}, timeout=300), _clear_4xx)  # fmt: skip
    has_choices = lambda j: isinstance(j.get("choices"), list)  # noqa: E731
    for name, path, body in (  # accepted by the request model: served, or refused cleanly
        ("n = 0", "/v1/completions", {**comp, "n": 0}),
        ("logprobs -1", "/v1/completions", {**comp, "logprobs": -1}),
        ("an invalid regex", "/v1/completions", {**comp, "regex": "("}),
        ("100 stop strings", "/v1/completions", {**comp, "stop": [f"s{i}" for i in range(100)]}),
        ("chat with no messages", "/v1/chat/completions", {**chat, "messages": []}),
    ):
        probe(name, "an answer or 4xx", lambda p=path, b=body: s.post(p, b, timeout=300),
              lambda r: _answer_or_4xx(r, has_choices))  # fmt: skip
    probe("unknown endpoint", "404", lambda: s.post("/v1/nothing_here", comp, timeout=60),
          lambda r: r.status_code == 404)  # fmt: skip
    probe("GET on /generate", "405",
          lambda: requests.get(s.url + "/generate", headers=s.headers, timeout=60),
          lambda r: r.status_code == 405)  # fmt: skip
    probe("n = 2", "two completions",
          lambda: s.post("/v1/completions", {**comp, "n": 2, "temperature": 0.8}, timeout=300),
          lambda r: r.status_code == 200 and len(r.json()["choices"]) == 2)  # fmt: skip
    probe("logprobs", "completion with logprobs",
          lambda: s.post("/v1/completions", {**comp, "logprobs": 2}, timeout=300),
          lambda r: r.status_code == 200
          and len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) > 0)  # fmt: skip
    probe("stop string", "text cut before the stop string",
          lambda: s.post("/generate", {"text": "Count: 1, 2, 3, 4,", "sampling_params": {
              "max_new_tokens": 32, "temperature": 0, "stop": [","]}}, timeout=300),
          lambda r: r.status_code == 200 and "," not in r.json()["text"])  # fmt: skip

    def streamed(r):
        if r.status_code != 200:
            return False
        lines = [ln for ln in r.iter_lines() if ln.startswith(b"data: ")]
        plain = s.post("/v1/completions", {**comp, "temperature": 0}, timeout=300).json()
        text = "".join(
            json.loads(ln[6:])["choices"][0]["text"] for ln in lines if b"[DONE]" not in ln
        )
        return lines[-1] == b"data: [DONE]" and text == plain["choices"][0]["text"]

    probe("streaming", "the same text as unstreamed, then [DONE]",
          lambda: s.post("/v1/completions", {**comp, "temperature": 0, "stream": True},
                         stream=True, timeout=300), streamed)  # fmt: skip
    if s.api_key:
        probe("no API key", "401",
              lambda: s.post("/v1/completions", comp, headers={}, timeout=60),
              lambda r: r.status_code == 401)  # fmt: skip
        probe("wrong API key", "401",
              lambda: s.post("/v1/completions", comp, timeout=60,
                             headers={"Authorization": "Bearer wrong"}),
              lambda r: r.status_code == 401)  # fmt: skip

    class _Run:  # the frontend program as a response-like result
        def __init__(self, p):
            self.status_code = 200 if p.returncode == 0 else 500
            self.text = p.stdout[-200:] if p.returncode == 0 else p.stderr[-400:]
            self.ok = p.returncode == 0 and "summary of both branches:" in p.stdout

    port = s.url.rsplit(":", 1)[1]
    cmd = [sys.executable, str(ROOT / "examples" / "dsl_fork.py"), "--port", port,
           "--filler-sentences", "50"] + (["--api-key", s.api_key] if s.api_key else [])  # fmt: skip
    probe("frontend program with fork", "both branches answered",
          lambda: _Run(subprocess.run(cmd, capture_output=True, text=True, timeout=600)),
          lambda r: r.ok)  # fmt: skip
    return out


# --- faults ------------------------------------------------------------------------


def _fault(s: Server, name: str, expected: str, run: Callable[[], tuple[bool, str, dict]]):
    try:
        ok, got, detail = run()
    except Exception as e:  # noqa: BLE001
        ok, got, detail = False, f"{type(e).__name__}: {e}", {}
    held = s.leaks()
    detail["held_after"] = held
    good = ok and not any(held.values()) and s.healthy()
    return Outcome(name, "fault", expected + "; nothing held afterwards", got, good, detail)


def _finish(r: requests.Response) -> str:
    return (
        r.json()["meta_info"]["finish_reason"]["type"]
        if r.status_code == 200
        else str(r.status_code)
    )


def _end(box: dict) -> str:
    """How an `_in_background` request ended: its finish reason, HTTP status or error."""
    return _finish(box["r"]) if "r" in box else repr(box.get("e"))


def _in_background(fn, *args) -> dict:
    box: dict = {}

    def run():
        try:
            box["r"] = fn(*args)
        except Exception as e:  # noqa: BLE001
            box["e"] = e

    box["t"] = threading.Thread(target=run, daemon=True)
    box["t"].start()
    return box


def abort_queued(s: Server, running: int = MAX_RUNNING) -> Outcome:
    """Fill every running slot with long decodes, queue more, abort the queued ones.

    The queued requests ask as many tokens as the fill: where the server retracts (the
    tiered home's probes server does every `RETRACT_EVERY` forwards), a queued request
    may take a retracted one's slot before the abort, and must still be running then."""

    def run():
        fill = [_in_background(s.generate, prompt(512, i), 4000) for i in range(running)]
        # The queued requests leave only once the fill holds every slot: sent together,
        # one could overtake a fill request and run, not wait, until the abort.
        deadline = time.time() + 120
        while s.psa_state()["running"] < running and time.time() < deadline:
            time.sleep(0.2)
        rids = [f"queued-{uuid.uuid4().hex}" for _ in range(4)]
        queued = [_in_background(s.generate, prompt(512, 100 + i), 4000, r)
                  for i, r in enumerate(rids)]  # fmt: skip
        time.sleep(3)
        for r in rids:
            s.abort(r)
        for b in queued:
            b["t"].join(120)
        ends = [_end(b) for b in queued]
        s.abort()  # then the fill
        for b in fill:
            b["t"].join(120)
        return all(e == "abort" for e in ends), f"queued requests ended {ends}", {}

    return _fault(s, "abort while queued", "finish_reason abort", run)


def abort_mid_prefill(s: Server) -> Outcome:
    def run():
        rid = f"prefill-{uuid.uuid4().hex}"
        b = _in_background(s.generate, prompt(min(16000, s.max_total_tokens // 2), 7), 64, rid)
        time.sleep(0.05)
        s.abort(rid)
        b["t"].join(300)
        end = _end(b)
        return end in ("abort", "length"), f"ended {end}", {}

    return _fault(s, "abort mid-prefill", "abort (or done first)", run)


def abort_mid_decode(s: Server) -> Outcome:
    def run():
        rid = f"decode-{uuid.uuid4().hex}"
        body = {"input_ids": prompt(2000, 3), "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        with s.post("/generate", body, stream=True, timeout=300) as r:
            chunks = 0
            last = None
            for ln in r.iter_lines():
                if not ln.startswith(b"data: ") or b"[DONE]" in ln:
                    continue
                chunks += 1
                last = json.loads(ln[6:])
                if chunks == 3:
                    s.abort(rid)
        end = last["meta_info"]["finish_reason"] if last else None
        ok = end is not None and end["type"] == "abort"
        return ok, f"stream ended after {chunks} chunks, finish {end}", {}

    return _fault(s, "abort mid-decode", "the stream ends with finish_reason abort", run)


def client_disconnect(s: Server, new_tokens: int = 16000, within_s: float = 10.0) -> Outcome:
    """A client closes its stream after two chunks: the server must abort the request,
    seen as it leaving the running set within `within_s`, far sooner than its
    `new_tokens` would take to decode (a server that kept decoding fails)."""

    def run():
        body = {"input_ids": prompt(2000, 4), "stream": True,
                "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                    "ignore_eos": True}}  # fmt: skip
        r = s.post("/generate", body, stream=True, timeout=300)
        got = 0
        for ln in r.iter_lines():
            got += ln.startswith(b"data: ")
            if got == 2:
                break
        r.close()  # the client goes away mid-stream
        t0 = time.time()
        while s.psa_state()["running"] and time.time() - t0 < within_s:
            time.sleep(0.2)
        left = s.psa_state()["running"] == 0
        took = time.time() - t0
        said = (
            f"left the server {took:.1f} s later" if left else f"still running after {took:.0f} s"
        )
        detail = {"seconds_to_leave": round(took, 2) if left else None}
        return left, f"closed after {got} chunks; the request {said}", detail

    return _fault(s, "client closes a stream", "the server aborts the request", run)


def abort_retracted(s: Server, concurrent: int = 24) -> Outcome:
    """Long decodes that outgrow the KV force retractions; abort everything then."""

    def run():
        before = s.psa_state()["retracted"]
        n_prompt = max(256, s.max_total_tokens // (2 * concurrent))
        bg = [_in_background(s.generate, prompt(n_prompt, 50 + i), 8 * n_prompt)
              for i in range(concurrent)]  # fmt: skip
        deadline = time.time() + 240
        while time.time() < deadline and s.psa_state()["retracted"] == before:
            time.sleep(0.5)
        retracted = s.psa_state()["retracted"] - before
        s.abort()
        for b in bg:
            b["t"].join(300)
        ends = sorted({_finish(b["r"]) if "r" in b else "error" for b in bg})
        return (
            retracted > 0 and "error" not in ends,
            f"{retracted} retractions, ends {ends}",
            {"retractions": retracted},
        )

    return _fault(s, "abort while retracted", "retractions happen, then all abort", run)


def abort_storm(s: Server, n: int = 200) -> Outcome:
    """n requests at once, each abandoned by its client (timeout) or aborted by rid."""

    def one(i: int):
        rid = f"storm-{i}-{uuid.uuid4().hex}"
        if i % 2:
            threading.Timer(random.uniform(0.1, 2.0), s.abort, (rid,)).start()
            try:
                return _finish(s.generate(prompt(256 + 37 * i, i), 2000, rid, timeout=300))
            except requests.RequestException as e:
                return type(e).__name__
        try:
            s.generate(prompt(256 + 37 * i, i), 2000, rid, timeout=random.uniform(0.2, 2.0))
            return "done"
        except requests.Timeout:
            return "client left"

    def run():
        with ThreadPoolExecutor(n) as ex:
            ends = list(ex.map(one, range(n)))
        counts = dict(Counter(ends))
        ok = set(counts) <= {"abort", "length", "client left", "done"}
        return ok, f"ends {counts}", {"ends": counts}

    return _fault(s, f"storm of {n} aborts", "every request aborted or done", run)


def overload(s: Server, n: int = 500, rate: float = 50.0, seed: int = 0) -> Outcome:
    """n requests of mixed lengths arriving at `rate`/s, far above what the server serves:
    each ends with a completion or a clear error; nothing is lost."""
    rng = random.Random(seed)
    longest = min(8192, s.max_total_tokens // 4)
    jobs = [(rng.randint(128, longest), rng.choice((16, 64, 256))) for _ in range(n)]

    def one(i: int):
        time.sleep(i / rate)
        try:
            r = s.generate(prompt(jobs[i][0], 1000 + i), jobs[i][1], timeout=1800)
        except requests.RequestException as e:
            return "lost: " + type(e).__name__
        if r.status_code == 200:
            return "done" if r.json()["meta_info"]["completion_tokens"] == jobs[i][1] else "short"
        return "4xx" if _clear_4xx(r) else f"lost: HTTP {r.status_code}"

    def run():
        t0 = time.time()
        peak = {"queued": 0, "deferrals": s.psa_state()["admission_deferrals"]}
        stop = threading.Event()

        def watch():
            while not stop.wait(1.0):
                load = requests.get(s.url + "/get_load", headers=s.headers, timeout=30)
                if load.ok:
                    q = sum(int(x.get("num_waiting_reqs", 0)) for x in _as_list(load.json()))
                    peak["queued"] = max(peak["queued"], q)

        w = threading.Thread(target=watch, daemon=True)
        w.start()
        with ThreadPoolExecutor(n) as ex:
            ends = list(ex.map(one, range(n)))
        stop.set()
        counts = dict(Counter(ends))
        lost = sum(v for k, v in counts.items() if k.startswith("lost") or k == "short")
        detail = {
            "ends": counts,
            "lost": lost,
            "seconds": round(time.time() - t0, 1),
            "peak_waiting": peak["queued"],
            "admission_deferrals": s.psa_state()["admission_deferrals"] - peak["deferrals"],
        }
        return lost == 0, f"ends {counts}, peak waiting {peak['queued']}", detail

    return _fault(s, f"overload: {n} requests at {rate:g}/s", "every request answered", run)


def _cached(r: requests.Response) -> int:
    return int(r.json()["meta_info"].get("cached_tokens") or 0) if r.status_code == 200 else 0


def shared_prefix_aborts(s: Server, n: int = 8, stem_tokens: int = 4096) -> Outcome:
    """`n` requests sharing one prompt stem, sent at once: two aborted as they start
    (prefilling or queued), two while decoding, the rest finish; then a request with the
    stem is served from the prefix cache (most of the stem cached), and nothing is held.
    The two aborted while decoding ask for 16000 tokens, so a fast GPU is still decoding
    them when the abort comes (1000 tokens took under 1.7 s on the H200)."""

    def run():
        stem = prompt(stem_tokens, 21)
        rids = [f"shared-{i}-{uuid.uuid4().hex}" for i in range(n)]
        new = [16000 if i in (2, 3) else 1000 for i in range(n)]
        bg = [_in_background(s.generate, stem + prompt(64, 210 + i), new[i], r)
              for i, r in enumerate(rids)]  # fmt: skip
        time.sleep(0.2)
        for r in rids[:2]:
            s.abort(r)
        time.sleep(1.5)
        for r in rids[2:4]:
            s.abort(r)
        for b in bg:
            b["t"].join(300)
        ends = [_end(b) for b in bg]
        again = s.generate(stem + prompt(64, 299), 8)
        cached = _cached(again)
        ok = (
            ends[:4] == ["abort"] * 4
            and ends[4:] == ["length"] * (n - 4)
            and _finish(again) == "length"
            and cached >= stem_tokens - 64  # its whole blocks (a tail block may be computed)
        )
        detail = {"ends": ends, "cached_tokens_after": cached}
        return ok, f"ends {ends}; a later request with the stem had {cached} cached", detail

    return _fault(s, "requests sharing a prefix aborted", "4 abort, the rest finish, "
                  "the stem still cached", run)  # fmt: skip


def prefix_evicted_then_reread(s: Server, doc_tokens: int = 6000, new: int = 16) -> Outcome:
    """A document's prefix pushed out of HBM by other prompts, then asked for again: the
    same answer as when it was computed or read from HBM (its first 4 tokens: the prefill
    paths round differently), and at the tiered home the prefix read from the host tier
    (counted in cached tokens) instead of computed again."""

    def run():
        doc = prompt(doc_tokens, 31) + prompt(32, 301)
        first = s.generate(doc, new)  # computes and caches the document
        warm = s.generate(doc, new)  # its prefix from HBM
        flood = -(-2 * s.max_total_tokens // doc_tokens)  # twice the KV the server holds
        for i in range(flood):
            s.generate(prompt(doc_tokens, 400 + i), 4)
        cold = s.generate(doc, new)
        outs = [
            r.json()["output_ids"] if r.status_code == 200 else None for r in (first, warm, cold)
        ]
        tiered = s.psa_state()["kv_home"] == "tiered"
        cached = (_cached(warm), _cached(cold))
        ok = (
            None not in outs
            and all(len(o) == new for o in outs)
            and outs[2][:4] in (outs[0][:4], outs[1][:4])
            and cached[0] >= doc_tokens - 64
            and (cached[1] >= doc_tokens - 64 if tiered else True)
        )
        detail = {"cached_tokens_warm_cold": cached, "flood_prompts": flood, "tiered": tiered}
        return ok, f"cached {cached[0]} then {cached[1]} after {flood} other prompts", detail

    return _fault(s, "a prefix evicted from HBM, then asked again",
                  "the same first tokens; tiered: read from the host tier", run)  # fmt: skip


def retract_shared_prefix(s: Server, n: int = MAX_RUNNING, stem_tokens: int = 4096) -> Outcome:
    """`n` requests sharing one stem decode until their KV outgrows the server's, so some
    are retracted (their stem shared with requests still running), then all run to their
    full length; the stem's cached share afterwards is reported."""

    def run():
        before = s.psa_state()["retracted"]
        stem = prompt(stem_tokens, 22)
        # together they need 1.3x the KV the server holds (the stem counted once)
        new = -(-13 * (s.max_total_tokens - stem_tokens) // (10 * n))
        bg = [_in_background(s.generate, stem + prompt(64, 220 + i), new) for i in range(n)]
        for b in bg:
            b["t"].join(300)
        got = [b["r"].json()["meta_info"]["completion_tokens"]
               if "r" in b and b["r"].status_code == 200 else None for b in bg]  # fmt: skip
        ends = [_end(b) for b in bg]
        retracted = s.psa_state()["retracted"] - before
        cached = _cached(s.generate(stem + prompt(64, 229), 4))
        ok = retracted > 0 and ends == ["length"] * n and got == [new] * n
        detail = {"retractions": retracted, "ends": ends, "new_tokens": new,
                  "stem_cached_after": cached}  # fmt: skip
        return (
            ok,
            f"{retracted} retractions, ends {sorted(set(ends))}, stem {cached} cached",
            detail,
        )

    return _fault(s, "retraction of requests sharing a prefix",
                  "retractions happen, every request runs to its length", run)  # fmt: skip


def abort_storm_staged_prefill(s: Server, n: int = 24, doc_tokens: int = 6000) -> Outcome:
    """A document's prefix pushed out of HBM (at the tiered home it waits in the host tier,
    so a request with it prefills by staging it back), then `n` requests with that prefix
    at once, each aborted within 0.6 s (mid staged prefill, queued or decoding); then the
    document is asked again: the same first tokens as before, nothing held."""

    def run():
        rng = random.Random(5)
        doc = prompt(doc_tokens, 41)
        ask = doc + prompt(32, 410)
        first, warm = s.generate(ask, 8), s.generate(ask, 8)
        for i in range(-(-2 * s.max_total_tokens // doc_tokens)):  # twice what HBM holds
            s.generate(prompt(doc_tokens, 420 + i), 4)
        rids = [f"staged-{i}-{uuid.uuid4().hex}" for i in range(n)]
        bg = [_in_background(s.generate, doc + prompt(32, 440 + i), 64, r)
              for i, r in enumerate(rids)]  # fmt: skip
        for r in rids:
            threading.Timer(rng.uniform(0.0, 0.6), s.abort, (r,)).start()
        for b in bg:
            b["t"].join(300)
        ends = [_end(b) for b in bg]
        again = s.generate(ask, 8)
        outs = [r.json()["output_ids"] if r.status_code == 200 else None
                for r in (first, warm, again)]  # fmt: skip
        counts = dict(Counter(ends))
        ok = (
            set(ends) <= {"abort", "length"}
            and "abort" in counts
            and None not in outs
            and outs[2][:4] in (outs[0][:4], outs[1][:4])
        )
        detail = {"ends": counts, "cached_tokens_after": _cached(again)}
        return ok, f"ends {counts}; the document asked again: {outs[2]}", detail

    return _fault(s, f"storm of {n} aborts on an evicted prefix",
                  "every request aborted or done, the document's answer unchanged", run)  # fmt: skip


def host_tier_full(s: Server, prompt_tokens: int = 8000, concurrent: int = MAX_RUNNING,
                   fill: float = 1.6) -> Outcome:  # fmt: skip
    """Distinct prompts holding `fill` times what the host tier holds (the tiered home:
    it fills with kept prefixes and its LRU gives room; the HBM home: as many prompts),
    `concurrent` at a time: every one answered to its length, and at the tiered home more
    blocks saved than the tier holds."""
    from sglang_psa.config import PSAConfig

    def run():
        wb = s.psa_state()["writeback"]
        block = PSAConfig().block_size  # the servers' (SERVER_ARGS leave it at the default)
        holds = wb["host_blocks_total"] * block if wb else 4 * 2**30 // KV_BYTES_PER_TOKEN
        count = -(-int(fill * holds) // prompt_tokens)
        saved0 = wb["blocks_saved"] if wb else 0

        def one(i: int) -> str:
            try:
                r = s.generate(prompt(prompt_tokens, 5000 + i), 4, timeout=900)
            except requests.RequestException as e:
                return "lost: " + type(e).__name__
            return _finish(r)

        with ThreadPoolExecutor(concurrent) as ex:
            ends = list(ex.map(one, range(count)))
        counts = dict(Counter(ends))
        wb = s.psa_state()["writeback"]
        saved = (wb["blocks_saved"] - saved0) if wb else None
        again = _finish(s.generate(prompt(prompt_tokens, 5000), 4))
        ok = (
            counts == {"length": count}
            and again == "length"
            and (wb is None or saved >= fill * 0.9 * wb["host_blocks_total"])
        )
        detail = {"prompts": count, "ends": counts, "blocks_saved": saved,
                  "host_blocks_total": wb and wb["host_blocks_total"]}  # fmt: skip
        return ok, f"{count} prompts: ends {counts}, {saved} blocks saved", detail

    return _fault(s, "the host tier full", "every prompt answered; the tier's LRU gave room",
                  run)  # fmt: skip


def _as_list(x):
    return x if isinstance(x, list) else [x]


def metrics_endpoint(s: Server) -> Outcome:
    """Not a fault: PSA's gauges are in /metrics (reported apart, kind "check")."""
    names = ("blocks_read_fraction", "running_requests", "admission_deferrals_total")
    text = requests.get(s.url + "/metrics", timeout=60).text
    missing = [n for n in names if f"sglang_psa:{n}{{" not in text]
    return Outcome("metrics", "check", "PSA gauges in /metrics", f"missing {missing}",
                   not missing)  # fmt: skip


# --- the tiered home's copy engine killed, and several servers ------------------------


def in_turn(s: Server, prompts: list[list[int]], new: int, during=None, cached=None) -> list:
    """`prompts` one after another (greedy, so batches and numerics are the same in every
    run), `during()` called in parallel; each completion's output ids, or the error text
    (and each prompt's tokens served from the prefix cache appended to `cached`)."""
    side = threading.Thread(target=during) if during is not None else None
    if side is not None:
        side.start()
    out = []
    for p in prompts:
        r = s.generate(p, new)
        out.append(r.json()["output_ids"] if r.status_code == 200 else r.text)
        if cached is not None:
            cached.append(_cached(r))
    if side is not None:
        side.join(60)
    return out


def kill_prompts(stem: int = 0) -> list[list[int]]:
    """The prompts `engine_kill` runs in the test and the benchmark: eight of 6-10K tokens;
    with `stem`, their first `stem` tokens are one text (a prefix the tree shares)."""
    head = prompt(stem, seed=100)
    return [head + prompt(6000 + 512 * i - stem, seed=i) for i in range(8)]


def engine_kill(s: Server, prompts: list[list[int]], new: int = 96, rank: int = -1) -> dict:
    """The tiered home's copy engine (of TP rank `rank`; -1: the last) SIGKILLed 0.3 s into
    a run of `prompts` (their first saves under way), against the same run unkilled. The
    prefix cache is flushed before each run. Returns what a test asserts and a benchmark
    records: requests, `lost` (no full completion), `changed` (a completion that differs
    from the unkilled run's), the engine restarts and pids before and after, host-tier
    reads during the killed run, and the write-back state once its saves settled (at most
    60 s): `settled` when no save is in flight, every planned block was saved or dropped
    and no request holds a host block (a prefix cache keeps some, unheld)."""
    import os
    import signal

    def writeback() -> dict:
        return s.psa_state()["writeback"]

    def pid_of(wb: dict) -> int:
        pids = wb["engine_pid"]
        return pids[rank] if isinstance(pids, list) else pids  # several TP ranks: a list

    assert s.post("/flush_cache", timeout=60).status_code == 200
    want = in_turn(s, prompts, new)
    before = writeback()

    def kill() -> None:
        time.sleep(0.3)
        os.kill(pid_of(writeback()), signal.SIGKILL)

    assert s.post("/flush_cache", timeout=60).status_code == 200
    reads = s.psa_state()["residency"]["units_read_host"]
    cached: list[int] = []
    got = in_turn(s, prompts, new, during=kill, cached=cached)
    host_reads = s.psa_state()["residency"]["units_read_host"] - reads
    after = writeback()
    deadline = time.time() + 60
    while writeback()["save_jobs_in_flight"] and time.time() < deadline:
        time.sleep(0.5)
    rep = writeback()
    full = [isinstance(o, list) and len(o) == new for o in got]
    return {
        "requests": len(prompts),
        "baseline_complete": sum(isinstance(o, list) and len(o) == new for o in want),
        "lost": full.count(False),
        "changed": sum(ok and a != b for ok, a, b in zip(full, got, want)),
        "engine_restarts": after["engine_restarts"] - before["engine_restarts"],  # summed
        "engine_pid_before": before["engine_pid"],
        "engine_pid_after": after["engine_pid"],
        "killed_pid": pid_of(before),
        "units_read_host": host_reads,
        "cached_tokens": cached,  # per prompt of the killed run
        "writeback_after": rep,
        "settled": rep["save_jobs_in_flight"] == 0
        and rep["blocks_saved"] + rep["dropped_blocks"] == rep["blocks_planned"]
        and rep["host_blocks_used"] == 0,
    }


@contextlib.contextmanager
def router(urls: list[str], port: int, log: Path):
    """SGLang's `sglang-router` (round robin) in front of `urls`, healthy: yields (its URL,
    its process) and stops it afterwards."""
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
        "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                raise SystemExit("the router exited:\n" + log.read_text()[-3000:])
            with contextlib.suppress(requests.RequestException):
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.time() > deadline:
                raise SystemExit("the router did not become healthy in 120 s")
            time.sleep(1)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(30)


def mixed_load(url: str, n: int, new: int, chats: int = 4, long_every: int = 4) -> dict:
    """`n` `/generate` requests (every `long_every`-th of 8-12K tokens, the others of
    0.5-3K) and `chats` OpenAI chat completions, all at once, to `url`: the responses by
    kind, and `failed` (not a 200 with a full answer), `wall_s`."""
    from concurrent.futures import ThreadPoolExecutor

    def length(i: int) -> int:
        return 8000 + 4000 * i // n if i % long_every == 0 else 500 + 97 * i % 2500

    def gen(i: int) -> requests.Response:
        sp = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": prompt(length(i), seed=i), "sampling_params": sp}
        return requests.post(url + "/generate", json=body, timeout=900)

    def chat(i: int) -> requests.Response:
        body = {
            "model": "default", "max_tokens": new, "temperature": 0,
            "messages": [{"role": "user", "content": f"Count from {i} to {i + 20}."}],
        }  # fmt: skip
        return requests.post(url + "/v1/chat/completions", json=body, timeout=900)

    def full(r: requests.Response, kind: str) -> bool:
        if r.status_code != 200:
            return False
        doc = r.json()
        if kind == "gen":
            return len(doc["output_ids"]) == new
        return bool(doc["choices"][0]["message"]["content"])

    t0 = time.time()
    with ThreadPoolExecutor(n + chats) as pool:
        g = [pool.submit(gen, i) for i in range(n)]
        c = [pool.submit(chat, i) for i in range(chats)]
        g, c = [f.result() for f in g], [f.result() for f in c]
    failed = [r for r in g if not full(r, "gen")] + [r for r in c if not full(r, "chat")]
    return {
        "generate": g,
        "chat": c,
        "failed": len(failed),
        "failures": [f"{r.status_code}: {r.text[:300]}" for r in failed],
        "wall_s": time.time() - t0,
    }


# Every fault probe, in the order they run (the benchmark and the GPU test both use this).
FAULTS = (abort_queued, abort_mid_prefill, abort_mid_decode, client_disconnect,
          abort_retracted, abort_storm, overload, shared_prefix_aborts,
          prefix_evicted_then_reread, retract_shared_prefix, abort_storm_staged_prefill,
          host_tier_full)  # fmt: skip


def faults(s: Server):
    """Every fault probe in turn, each outcome as it comes."""
    for probe in FAULTS:
        yield probe(s)
