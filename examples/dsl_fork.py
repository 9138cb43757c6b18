"""An SGLang frontend program (several `gen` calls and a `fork`) against a PSA server.

    python -m sglang.launch_server --model-path DIR --sparse-mode psa --port 30000
    python examples/dsl_fork.py --port 30000

The program reads a long generated document once (its KV is saved to the host
pool and shared by both branches through prefix sharing), then asks two
questions in parallel branches and a final summary: nothing in it knows that
decode attention is sparse.
"""

from __future__ import annotations

import argparse

import sglang as sgl


@sgl.function
def document_qa(s, document: str, questions: list[str]):
    s += sgl.user(f"Read this document.\n\n{document}\n\nReply 'ready' when done.")
    s += sgl.assistant(sgl.gen("ack", max_tokens=4, temperature=0))
    branches = s.fork(len(questions))
    for branch, q in zip(branches, questions):
        branch += sgl.user(q)
        branch += sgl.assistant(sgl.gen("answer", max_tokens=24, temperature=0))
    branches.join()
    answers = "; ".join(b["answer"].strip() for b in branches)
    s += sgl.user(f"Summarise these answers in one line: {answers}")
    s += sgl.assistant(sgl.gen("summary", max_tokens=32, temperature=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--filler-sentences", type=int, default=400)
    ap.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    args = ap.parse_args()
    sgl.set_default_backend(
        sgl.RuntimeEndpoint(f"http://127.0.0.1:{args.port}", api_key=args.api_key)
    )
    filler = " ".join(
        f"Line {i} of the report notes nothing unusual." for i in range(args.filler_sentences)
    )
    document = filler + " The vault code is 4417. " + filler
    state = document_qa.run(
        document=document,
        questions=["What is the vault code?", "What do most lines of the report note?"],
    )
    print("ack:", state["ack"].strip())
    print("summary of both branches:", state["summary"].strip())


if __name__ == "__main__":
    main()
