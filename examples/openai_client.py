"""Talk to a running `--sparse-mode psa` server through the OpenAI-compatible API.

    python -m sglang.launch_server --model-path DIR --sparse-mode psa --port 30000
    python examples/openai_client.py --port 30000

Sends one chat request streamed token by token and one plain completion; the
server's API is SGLang's own, so any OpenAI client works unchanged.
"""

from __future__ import annotations

import argparse

import openai


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none")
    stream = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": "Name three prime numbers."}],
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    done = client.completions.create(
        model=args.model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    print(repr(done.choices[0].text))


if __name__ == "__main__":
    main()
