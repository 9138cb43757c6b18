"""One real server at a time: start, wait for health, warm up, drive with SGLang's own
client (or, for multi-turn chat, with `run_chat`), read its counters, stop.

Contract: `Server` owns a `python -m sglang.launch_server` process group (it and
the scheduler/detokenizer processes it spawns); leaving the `with` block
terminates the whole group, so the next system starts on a free GPU. A server
that exits or stays unhealthy raises `ServerFailed` with the tail of its log.
`bench_serving` runs in one worker process per stage (`Client`: `client_ids.py
--worker`, SGLang's own client run once per command line, sending prompts as token ids
or as text) with `stubs/` on its path for the `datasets` import it does not use.
`bench_serving` cannot wait for an answer before sending the next turn, so chat
workloads are driven by `run_chat`, which writes the same per-request record.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parent
STUBS = HERE / "stubs"
LOG_TAIL_LINES = 60
CLIENT_IDS = HERE / "client_ids.py"  # bench_serving sending prompts as token ids
# How bench_command names the client for each prompt format (split_command reads it back)
CLIENTS = {"ids": [str(CLIENT_IDS)], "text": ["-m", "sglang.bench_serving"]}
PROMPT_FORMATS = tuple(CLIENTS)  # how bench_serving sends prompts (bench_command)
PROFILE_POLL_S = 0.25  # how often `profile_decode` reads the server's new log lines


class ServerFailed(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[serving {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class Server:
    def __init__(
        self,
        cmd: list[str],
        port: int,
        log_path: Path,
        env: dict | None = None,
        cpus: list[int] | None = None,
    ):
        """`cpus`: the server's processes run on these CPUs only
        (`machine_samples.split_cpus`)."""
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.env, self.cpus = env, cpus
        self.proc: subprocess.Popen | None = None
        self.startup_s = float("nan")

    def __enter__(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log("$ " + " ".join(self.cmd))
        self._log_file = self.log_path.open("w")
        mine = os.sched_getaffinity(0) if self.cpus else None
        try:
            if self.cpus:  # the child inherits this thread's CPUs at fork
                os.sched_setaffinity(0, self.cpus)
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        finally:
            if mine is not None:
                os.sched_setaffinity(0, mine)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until `/health` answered 200; raises ServerFailed on exit or time-out."""
        t0 = time.time()
        last = t0
        while time.time() - t0 < timeout:
            if self.healthy():
                self.startup_s = time.time() - t0
                log(f"healthy after {self.startup_s:.0f} s")
                return self.startup_s
            if time.time() - last > 30:
                last = time.time()
                log(
                    f"waiting for the server ({time.time() - t0:.0f} s): {_last_line(self.log_path)}"
                )
            time.sleep(1.0)
        raise ServerFailed(
            f"the server was not healthy after {timeout:.0f} s; last lines of "
            f"{self.log_path}:\n{tail(self.log_path)}"
        )

    def get(self, path: str, timeout: float = 60) -> dict:
        r = requests.get(self.url + path, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def generate(self, text: str, max_new_tokens: int, timeout: float = 600) -> dict:
        body = {
            "text": text,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        }
        r = requests.post(self.url + "/generate", json=body, timeout=timeout)
        if r.status_code != 200:
            raise ServerFailed(f"warm-up request failed: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def flush_cache(self, check: bool = False) -> None:
        """Drop the prefix cache (the server must be idle), so no timed request reuses the KV
        of a warm-up or of an earlier run. `check`: a reply other than 200 raises
        ServerFailed instead of being logged."""
        r = requests.post(self.url + "/flush_cache", timeout=60)
        if r.status_code != 200:
            if check:
                raise ServerFailed(f"/flush_cache answered {r.status_code}: {r.text[:200]}")
            log(f"flush_cache answered {r.status_code}: {r.text[:200]}")

    def log_size(self) -> int:
        self._log_file.flush()
        return self.log_path.stat().st_size

    def log_text(self, start: int = 0, end: int | None = None) -> str:
        with self.log_path.open("rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(max(0, end - start))
        return data.decode(errors="replace")

    def healthy(self) -> bool:
        """Whether `/health` answers 200 now; raises ServerFailed if the server exited."""
        if self.proc.poll() is not None:
            raise ServerFailed(
                f"the server exited with code {self.proc.returncode} during start-up; "
                f"last lines of {self.log_path}:\n{tail(self.log_path)}"
            )
        try:
            return requests.get(self.url + "/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def pause(self) -> None:
        """Stop every process of the server (SIGSTOP to its group): it keeps its GPU memory
        and takes no CPU, so a server started beside the measured one costs it nothing."""
        _signal_group(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        _signal_group(self.proc.pid, signal.SIGCONT)

    def stop(self, grace: float = 15) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGCONT)  # a paused server, to shut down
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.proc.pid, signal.SIGKILL)  # the scheduler and detokenizer too
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log_file.close()
        self.proc = None
        time.sleep(2.0)  # let the driver release the GPU memory of the killed processes


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _last_line(path: Path) -> str:
    lines = tail(path, 1)
    return lines[-200:] if lines else ""


def client_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUBS), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def bench_command(
    python: str,
    url: str,
    model_dir: str,
    dataset: Path,
    num_prompts: int,
    rate: float,
    fixed_output: int | None,
    seed: int,
    out_file: Path,
    prompt_format: str = "ids",
) -> list[str]:
    """`bench_serving`'s command line. `prompt_format`: "ids" sends each prompt as token
    ids (`client_ids.py`: TTFT without the tokenizer manager's backlog), "text" as text."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format {prompt_format!r}: one of {', '.join(PROMPT_FORMATS)}")
    client = CLIENTS[prompt_format]
    cmd = [
        python, *client,
        "--backend", "sglang",
        "--base-url", url,
        "--model", model_dir, "--tokenizer", model_dir,
        "--dataset-name", "custom", "--dataset-path", str(dataset),
        "--num-prompts", str(num_prompts),
        "--request-rate", "inf" if rate == float("inf") else f"{rate:g}",
        "--seed", str(seed),
        "--warmup-requests", "0",  # warmed up by the driver with prompts outside the dataset
        "--output-file", str(out_file), "--output-details",
        "--cache-report",  # each request's prompt tokens served from the prefix cache
        "--disable-tqdm",
        "--ready-check-timeout-sec", "0",
    ]  # fmt: skip
    if fixed_output is not None:
        cmd += ["--sharegpt-output-len", str(fixed_output)]
        # bench_serving's own sampling parameters (greedy, EOS ignored, every request this
        # long), plus the end-of-turn token kept in the text: the completion a user would
        # see ends there (`workloads.answer_ids`). The body replaces its sampling_params.
        sampling = {
            "temperature": 0.0,
            "max_new_tokens": fixed_output,
            "ignore_eos": True,
            "skip_special_tokens": False,
        }
        cmd += ["--extra-request-body", json.dumps({"sampling_params": sampling})]
    return cmd


class Client:
    """`bench_serving` for every timed run of a stage, in one worker process
    (`client_ids.py --worker`): SGLang's benchmark imported, each tokenizer loaded and
    each prompt tokenized once per stage rather than once per run (~10 s a run on the
    CPU machine at 16K, more on the GPU host). A run is still the command line
    `bench_command` gives, logged, so it can be replayed alone. `start` launches the
    worker early (its imports overlap the servers' start-up); a worker that dies is
    reported with the run's log and the next run starts a fresh one; one that outlives a
    run's time is killed."""

    WORKER = CLIENT_IDS  # run as `WORKER --worker`

    def __init__(self, log_path: Path | None = None) -> None:
        self.log_path = log_path  # the worker's own output (its start, between runs)
        self._proc: subprocess.Popen | None = None
        self._python: str | None = None
        self._ready = False

    def start(self, python: str) -> None:
        if self._proc is not None and self._proc.poll() is None and self._python == python:
            return
        self.close()
        cmd = [python, str(self.WORKER), "--worker"]
        err = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            err = self.log_path.open("a")
        try:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                env=client_env(), text=True, start_new_session=True,
            )  # fmt: skip
        finally:
            if err is not subprocess.DEVNULL:
                err.close()
        self._python, self._ready = python, False

    def run(self, cmd: list[str], log_path: Path, timeout: float) -> int:
        """Run `cmd` (a `bench_command`) in the worker, its output to `log_path`; its exit
        code. Raises ServerFailed when the worker dies or the run outlives `timeout`."""
        python, fmt, argv = split_command(cmd)
        self.start(python)
        deadline = time.time() + timeout
        if not self._ready:  # the worker's imports, once
            self._reply(deadline, log_path, "ready")
            self._ready = True
        msg = {"argv": argv, "log": str(log_path), "prompt_format": fmt}
        try:
            self._proc.stdin.write(json.dumps(msg) + "\n")
            self._proc.stdin.flush()
        except OSError:
            pass  # it died: _reply says so
        return int(self._reply(deadline, log_path, "rc"))

    def _reply(self, deadline: float, log_path: Path, key: str):
        proc = self._proc
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(max(0.0, deadline - time.time())):
                self.close()
                raise ServerFailed(
                    "bench_serving had not finished when the stage's time budget ran out; "
                    f"see {log_path}"
                )
        line = proc.stdout.readline()
        if not line:
            rc = proc.wait()
            self.close()
            own = f"\nits own log {self.log_path}:\n{tail(self.log_path)}" if self.log_path else ""
            raise ServerFailed(
                f"the bench_serving worker exited with code {rc}; last lines of {log_path}:\n"
                f"{tail(log_path)}{own}"
            )
        return json.loads(line)[key]

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()


def split_command(cmd: list[str]) -> tuple[str, str, list[str]]:
    """A `bench_command` as (python, prompt format, bench_serving's arguments)."""
    for fmt, client in CLIENTS.items():
        if cmd[1 : 1 + len(client)] == client:
            return cmd[0], fmt, cmd[1 + len(client) :]
    raise ValueError(f"not a bench_command: {cmd[:3]}")


def run_bench(
    client: Client,
    cmd: list[str],
    server: Server,
    log_path: Path,
    out_file: Path,
    timeout: float,
    profile: tuple[int, Path] | None = None,
) -> dict:
    """Run `bench_serving` (`cmd`, by `client`); show progress from the server's decode
    log lines meanwhile. Returns the JSON line it wrote (with per-request details).
    `profile` (steps, folder): once decoding runs with no request queued, SGLang's
    profiler records that many forward passes into the folder (`profile_decode`)."""
    out_file.unlink(missing_ok=True)
    log("$ " + " ".join(cmd))
    with watching(server, profile):
        rc = client.run(cmd, log_path, timeout)
    if rc != 0 or not out_file.exists():
        raise ServerFailed(
            f"bench_serving exited with code {rc}; last lines of {log_path}:\n{tail(log_path)}"
        )
    return json.loads(out_file.read_text().splitlines()[-1])


@contextlib.contextmanager
def watching(server: Server, profile: tuple[int, Path] | None = None):
    """While the block runs: progress from the server's decode log lines every 20 s, and
    with `profile` (steps, folder) the decode profile (`profile_decode`)."""
    stop = threading.Event()
    threading.Thread(target=_progress, args=(server, stop), daemon=True).start()
    if profile:
        args = (server, stop, *profile, server.log_size())
        threading.Thread(target=profile_decode, args=args, daemon=True).start()
    try:
        yield
    finally:
        stop.set()


class InfoSamples:
    """`/get_server_info` of `server` every `period_s` on a thread while the block runs,
    each answer reduced by `digest` (answers it makes None are dropped): `samples`, a list
    of `{"t": time.time(), **digest(info)}`. An answer that fails is skipped; the run goes
    on. The server answers between scheduling rounds, so a sample costs the run about one
    round's host time."""

    def __init__(self, server: Server, digest: Callable[[dict], dict | None], period_s=5.0):
        self.server, self.digest, self.period_s = server, digest, period_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                got = self.digest(self.server.get("/get_server_info", timeout=self.period_s))
            except (requests.RequestException, ValueError):
                continue
            if got is not None:
                self.samples.append({"t": time.time(), **got})

    def __enter__(self) -> InfoSamples:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def stream_generate(url: str, text: str, max_new_tokens: int, timeout: float) -> dict:
    """One streamed `/generate` request as `bench_serving` sends it (greedy, EOS ignored):
    `ttft` (s), `itl` (the gap before each later token: a chunk's gap spread over the
    tokens it brought), `text`, `output_len`, `cached_tokens` (the prompt tokens the
    server served from its prefix cache, `meta_info.cached_tokens`; None when it says
    nothing) and `error` (None, or why the request failed)."""
    body = {
        "text": text,
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        },
        "stream": True,
    }
    out = {"ttft": None, "itl": [], "text": "", "output_len": 0, "cached_tokens": None}
    t0 = last = time.perf_counter()
    try:
        with requests.post(url + "/generate", json=body, stream=True, timeout=timeout) as r:
            if r.status_code != 200:
                return out | {"error": f"HTTP {r.status_code}: {r.text[:500]}"}
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter()
                data = json.loads(line[6:])
                meta = data.get("meta_info") or {}
                out["cached_tokens"] = meta.get("cached_tokens", out["cached_tokens"])
                n = meta.get("completion_tokens", out["output_len"])
                if n <= out["output_len"]:
                    continue
                if out["ttft"] is None:
                    out["ttft"] = now - t0
                else:
                    out["itl"] += [(now - last) / (n - out["output_len"])] * (n - out["output_len"])
                last, out["output_len"], out["text"] = now, n, data.get("text", out["text"])
    except (requests.RequestException, ValueError) as e:
        return out | {"error": f"{type(e).__name__}: {e}"}
    return out | {"error": None if out["output_len"] else "no output tokens"}


BUDGET_SPENT = "not sent: the stage's time budget ran out"


def run_chat(
    url: str,
    conversations: list[list],
    starts: list[float],
    deadline: float,
    send: Callable[[str, str, int, float], dict] = stream_generate,
) -> dict:
    """Drive conversations as their users would. Conversation `i` sends its first turn
    `starts[i]` s after the run starts; each later turn is sent once the answer to the
    turn before has returned and the turn's `wait_s` (the user's think time) has passed,
    never earlier. A turn is a `workloads.Row` (its `prompt` is the whole history plus the
    new message); `send(url, prompt, output_len, timeout)` sends it (`stream_generate`).
    A failed turn ends its conversation: the later turns are recorded as not sent.

    Returns what `bench_serving --output-details --cache-report` writes: the run's
    duration (start to the last answer) and throughputs, `idle_duration` (the duration had
    every answer returned the moment its turn was sent: the last conversation's start plus
    its think times, what bounds the run's throughput whatever the server), and per
    request, in the order of
    the conversations' turns, `input_lens`, `output_lens`, `ttfts`, `itls`,
    `generated_texts`, `errors` and `cached_tokens`, plus `sent_s` and `returned_s`
    (seconds from the start). Raises ServerFailed when a turn could not be sent or
    answered before `deadline` (time.time())."""
    t0 = time.perf_counter()
    wall0 = time.time()

    def converse(turns: list, start: float) -> list[dict]:
        done, failed = [], None
        for row in turns:
            if failed is not None:
                done.append({"error": f"not sent: turn {failed} failed", "sent": None})
                continue
            at = done[-1]["returned"] + row.wait_s if done else start
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            left = deadline - time.time()
            if left <= 0:
                failed = row.turn
                done.append({"error": BUDGET_SPENT, "sent": None})
                continue
            sent = time.perf_counter() - t0
            res = send(url, row.prompt, row.output_len, left)
            returned = time.perf_counter() - t0
            done.append(res | {"sent": sent, "returned": returned})
            failed = row.turn if res["error"] else None
        return done

    with cf.ThreadPoolExecutor(max(1, len(conversations))) as pool:
        jobs = [pool.submit(converse, c, s) for c, s in zip(conversations, starts)]
        turns = [t for j in jobs for t in j.result()]
    rows = [r for c in conversations for r in c]
    if time.time() > deadline or any(t["error"] == BUDGET_SPENT for t in turns):
        raise ServerFailed(
            f"the chat had not finished when the stage's time budget ran out "
            f"({deadline - wall0:.0f} s left for it)"
        )
    ok = [(r, t) for r, t in zip(rows, turns) if not t["error"]]
    duration = max([t["returned"] for t in turns if t["sent"] is not None], default=0.0)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    idle = max((s + sum(r.wait_s for r in c) for c, s in zip(conversations, starts)), default=0.0)
    return {
        "duration": duration,
        "idle_duration": idle,
        "completed": len(ok),
        "output_throughput": per_s(sum(t["output_len"] for _, t in ok)),
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(sum(r.prompt_len for r, _ in ok)),
        "max_concurrent_requests": max_in_flight(turns),
        "input_lens": [r.prompt_len for r in rows],
        "output_lens": [t.get("output_len", 0) for t in turns],
        "ttfts": [t.get("ttft") for t in turns],
        "itls": [t.get("itl", []) for t in turns],
        "generated_texts": [t.get("text", "") for t in turns],
        "errors": [t["error"] or "" for t in turns],
        "cached_tokens": [t.get("cached_tokens") for t in turns],
        "sent_s": [t["sent"] for t in turns],
        "returned_s": [t.get("returned") for t in turns],
    }


def max_in_flight(turns: list[dict]) -> int:
    """The most requests sent and not yet answered at one moment."""
    events = sorted(
        (when, step)
        for t in turns
        if t["sent"] is not None
        for when, step in ((t["sent"], 1), (t["returned"], -1))
    )
    most = now = 0
    for _, step in events:  # at a tie the answer (-1) comes first
        now += step
        most = max(most, now)
    return most


def _progress(server: Server, stop: threading.Event, every: float = 20.0) -> None:
    from analysis import parse_decode_lines  # same folder; imported lazily for the thread

    start = server.log_size()
    while not stop.wait(every):
        lines = parse_decode_lines(server.log_text(start))
        if lines:
            last = lines[-1]
            log(
                f"  decoding: {last['running']} running, {last['queue']} queued, "
                f"{last['gen_tok_s']:.0f} tok/s"
            )
        else:
            log("  prefilling (no decode line yet)")


def profile_decode(
    server: Server, stop: threading.Event, steps: int, folder: Path, start: int
) -> None:
    """At the first decode log line (after byte `start` of the server's log) with no
    request queued, every prompt is prefilled: ask SGLang's profiler for `steps` forward
    passes, GPU activity, traces into `folder` (the server writes them when the passes
    are done; the export stalls it meanwhile, so the run's own figures are perturbed)."""
    from analysis import parse_decode_lines  # same folder; imported lazily for the thread

    seen = start
    while not stop.wait(PROFILE_POLL_S):
        end = server.log_size()
        text = server.log_text(seen, end)
        seen += len(text.encode()) - len(text.rsplit("\n", 1)[-1].encode())  # whole lines
        if any(line["queue"] == 0 for line in parse_decode_lines(text)):
            folder.mkdir(parents=True, exist_ok=True)
            body = {"num_steps": steps, "activities": ["GPU"], "output_dir": str(folder)}
            # With `num_steps` SGLang answers once the steps are recorded.
            try:
                r = requests.post(server.url + "/start_profile", json=body, timeout=600)
                log(f"  profiled {steps} decode steps: HTTP {r.status_code} {r.text.strip()}")
            except requests.RequestException as e:
                log(f"  profiling failed: {e}")
            return


def stop_profile(server: Server) -> None:
    """End a profile that is still recording (the run ended first), so its trace is written."""
    try:
        requests.post(server.url + "/stop_profile", timeout=300)
    except requests.RequestException as e:
        log(f"  stop_profile failed: {e}")


def python() -> str:
    return sys.executable
