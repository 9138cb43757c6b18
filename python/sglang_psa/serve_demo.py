"""GPU demo: SGLang serving the small real test model with `--sparse-mode psa`.

    python -m sglang_psa.demo            # on a machine with a GPU and SGLang installed

Starts `python -m sglang.launch_server` with the plugin's flags on SmolLM2-135M
(`../shared/MODELS.md`), waits until it is healthy, asks the long-document
questions of the CPU demo through `/generate`, prints the answers, whether
they are right, and the fraction of KV blocks decode attention read (from
`/get_server_info`). Then it keeps serving at the printed URL until Ctrl-C
(`--exit-after-demo` stops it instead).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from sglang_psa.models import ensure_model


def launch(
    model_dir: Path, port: int, extra: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
        "--port", str(port), "--sparse-mode", "psa", "--sampling-backend", "pytorch", *extra,
    ]  # fmt: skip
    shown = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    print("$", *([shown] if shown else []), " ".join(cmd), f"> {log}", flush=True)
    full = None if env is None else {**os.environ, **env}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=full)


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 900) -> None:
    import requests

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited (code {proc.returncode}); see {log}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                print(f"\nserver ready after {time.time() - t0:.0f} s", flush=True)
                return
        except requests.RequestException:
            pass
        print(".", end="", flush=True)
        time.sleep(3)
    raise SystemExit(f"the server did not become healthy within {timeout:.0f} s; see {log}")


def ask(url: str, tok, doc: str, questions) -> int:
    import requests

    from sglang_psa.eval.runner import chat_parts

    right = 0
    for task in questions:
        head, tail = chat_parts(tok, doc, task.question)
        r = requests.post(
            f"{url}/generate",
            json={
                "input_ids": head + tail,
                "sampling_params": {"temperature": 0, "max_new_tokens": task.max_new_tokens},
            },
            timeout=600,
        )
        r.raise_for_status()
        text = r.json()["text"].strip().replace("\n", " ")
        ok = task.score(text)
        right += ok
        print(f"  {'OK ' if ok else 'NO '} {task.question}\n      -> {text!r}", flush=True)
    return right


def main(argv: list[str] | None = None) -> int:
    from sglang_psa.eval.tasks import demo_document

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--context-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--exit-after-demo", action="store_true")
    ap.add_argument("--log", type=Path, default=Path("sglang-psa-server.log"))
    ap.add_argument("server_args", nargs="*", help="extra launch_server flags (after --)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    model_dir = ensure_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    doc, questions = demo_document(count, args.context_tokens, args.seed)
    url = f"http://127.0.0.1:{args.port}"
    proc = launch(model_dir, args.port, args.server_args, args.log)
    try:
        wait_healthy(proc, url, args.log)
        print(f"{len(questions)} questions about a {args.context_tokens}-token document:")
        right = ask(url, tok, doc, questions)
        import requests

        info = requests.get(f"{url}/get_server_info", timeout=30).json()
        psa = info["internal_states"][0].get("psa", {})
        frac = psa.get("blocks_read_fraction")
        print(
            f"{right}/{len(questions)} right; decode attention read "
            f"{'?' if frac is None else f'{100 * frac:.1f}%'} of the KV blocks; "
            f"admission: {psa.get('admitted')} admitted, {psa.get('retracted')} retracted",
            flush=True,
        )
        if args.exit_after_demo:  # SmolLM2-135M is weak: wrong answers are not a failure
            return 0
        print(f"serving at {url} (OpenAI API under /v1); Ctrl-C stops it", flush=True)
        proc.wait()
        return proc.returncode or 0
    except KeyboardInterrupt:
        return 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    raise SystemExit(main())
