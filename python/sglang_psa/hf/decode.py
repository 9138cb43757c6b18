"""Greedy decoding that shares one dense prefill among several decode policies.

Long-context evaluation on CPU is dominated by prefill; the decode policies
under comparison (dense, PSA at several ε, top-k at several budgets) only
differ in decode. A `Session` prefills a context once, and each
`decode(policy)` generates from it and then crops the KV cache back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from sglang_psa.hf.attention import ATTN_NAME, DecodePolicy, install, runtime


def load_model(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    """Model and tokenizer from a HF folder, with the `psa` attention function selected."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    install()
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation=ATTN_NAME
    ).to(device)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    return model, tok


@dataclass
class Decoded:
    tokens: list[int]
    text: str
    # Per layer: fraction of KV blocks read, one value per (step, request, KV head).
    layer_fractions: dict[int, torch.Tensor] = field(repr=False, default_factory=dict)

    def kv_fraction(self) -> float:
        """Mean fraction of KV blocks read over layers, steps and KV heads."""
        vals = [f for f in self.layer_fractions.values() if f.numel()]
        return float(torch.cat(vals).mean()) if vals else float("nan")


class Session:
    """One context kept in a transformers KV cache, decoded under several policies."""

    def __init__(self, model, tokenizer) -> None:
        self.model, self.tok = model, tokenizer
        self.cache = None
        self.length = 0
        self.next_logits: torch.Tensor | None = None

    @property
    def head_dim(self) -> int:
        c = self.model.config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @torch.inference_mode()
    def extend(self, ids: list[int], chunk: int = 4096, progress=None) -> None:
        """Append tokens with dense (prefill) attention, in chunks to bound memory;
        `progress(done, total)` is called after each chunk."""
        from transformers import DynamicCache

        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config)
        dev = self.model.device
        for s in range(0, len(ids), chunk):
            part = torch.tensor([ids[s : s + chunk]], device=dev)
            out = self.model(
                input_ids=part, past_key_values=self.cache, use_cache=True, logits_to_keep=1
            )
            self.length += part.shape[1]
            if progress is not None:
                progress(s + part.shape[1], len(ids))
        self.next_logits = out.logits[0, -1].float()

    def rewind(self, length: int) -> None:
        """Drop every token after the first `length`."""
        current = self.cache.get_seq_length()
        extra = current - length
        if extra < 0:
            raise ValueError(f"cannot rewind a {current}-token context to {length} tokens")
        if extra:
            # A negative count ("remove this many") means the same in every transformers 5.x;
            # a positive one (a target length) is refused by newer releases.
            self.cache.crop(-extra)
        self.length = length

    @torch.inference_mode()
    def decode(
        self, policy: DecodePolicy, max_new_tokens: int, stop_ids: set[int] | None = None
    ) -> Decoded:
        """Greedy tokens after the current context; the context is unchanged afterwards."""
        assert self.next_logits is not None, "extend() the session first"
        rt = runtime()
        self._rows(1)
        rt.reset()
        start = self.length
        stop_ids = stop_ids or set()
        tokens: list[int] = []
        nxt = int(self.next_logits.argmax())
        with rt.use(policy):
            for _ in range(max_new_tokens):
                tokens.append(nxt)
                if nxt in stop_ids or len(tokens) == max_new_tokens:
                    break
                nxt = int(self._feed(nxt).argmax())
        fractions = rt.layer_fractions()
        self.rewind(start)
        rt.reset()
        text = self.tok.decode([t for t in tokens if t not in stop_ids], skip_special_tokens=True)
        return Decoded(tokens, text, fractions)

    @torch.inference_mode()
    def decode_rows(
        self, policies: list[DecodePolicy], steps: int, kernels: bool = False
    ) -> RowsDecoded:
        """Greedy decoding of `steps` tokens under every policy at once, one batch row each
        (no early stop); the context is unchanged afterwards. Equal to `decode` per policy
        up to the numerics of a larger batch. `kernels`: sparse rows run the Triton
        kernels (GPU), see `PSARuntime.use_rows`."""
        assert self.next_logits is not None, "extend() the session first"
        rt, start = runtime(), self.length
        self._rows(len(policies))
        rt.reset()
        nxt = self.next_logits.argmax().repeat(len(policies))
        out = [nxt]
        with rt.use_rows(policies, kernels):
            for _ in range(steps - 1):
                nxt = self._feed_rows(nxt).argmax(-1)
                out.append(nxt)
        tokens = torch.stack(out, 1).tolist()
        fractions = rt.row_fractions() if steps > 1 else []
        fractions = [1.0 if p.kind == "dense" else f for p, f in zip(policies, fractions)]
        self.rewind(start)
        rt.reset()
        return RowsDecoded(tokens, fractions)

    @torch.inference_mode()
    def forced_kl_rows(
        self, policies: list[DecodePolicy], tokens: list[int], kernels: bool = False
    ) -> list[float]:
        """Teacher forcing as `forced_logprobs`, every policy at once: per policy the mean
        next-token KL from the first policy (the reference, normally dense) along `tokens`.
        The context is unchanged afterwards."""
        rt, start = runtime(), self.length
        self._rows(len(policies))
        rt.reset()
        kl = torch.zeros(len(policies), device=self.model.device)
        with rt.use_rows(policies, kernels):
            for t in tokens[:-1]:
                feed = torch.full((len(policies),), t, device=self.model.device)
                lp = torch.log_softmax(self._feed_rows(feed).float(), -1)
                kl += step_kl(lp[0], lp)
        self.rewind(start)
        rt.reset()
        n = len(tokens) - 1
        return (kl / n).tolist() if n else [float("nan")] * len(policies)

    def _rows(self, n: int) -> None:
        """Make the cache hold the context `n` times over (rows are equal after a rewind)."""
        rows = self.cache.layers[0].keys.shape[0]
        if rows == n:
            return
        if rows != 1:
            self.cache.batch_select_indices(torch.zeros(1, dtype=torch.long))
        self.cache.batch_repeat_interleave(n)

    def _feed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step, row `i` on `tokens[i]`: `[rows, vocab]` next-token logits."""
        out = self.model(input_ids=tokens[:, None], past_key_values=self.cache, use_cache=True)
        self.length += 1
        return out.logits[:, -1]

    def _feed(self, token: int) -> torch.Tensor:
        """One decode step on `token` under the policy in use: the next-token logits."""
        out = self.model(
            input_ids=torch.tensor([[token]], device=self.model.device),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.length += 1
        return out.logits[0, -1]

    @torch.inference_mode()
    def forced_logprobs(self, policy: DecodePolicy, tokens: list[int]) -> torch.Tensor:
        """Teacher forcing: feed `tokens[:-1]` after the context under `policy`, one decode
        step each; returns `[len(tokens) - 1, vocab]` float32 log-probabilities, row `i` the
        distribution `tokens[i + 1]` follows. (The first token follows the prefill, dense
        under every policy.) The context is unchanged afterwards."""
        rt = runtime()
        self._rows(1)
        rt.reset()
        start = self.length
        rows = []
        with rt.use(policy):
            for t in tokens[:-1]:
                rows.append(torch.log_softmax(self._feed(t).float(), -1))
        self.rewind(start)
        rt.reset()
        vocab = self.next_logits.shape[-1]
        return torch.stack(rows) if rows else torch.zeros(0, vocab)


@dataclass
class RowsDecoded:
    """`Session.decode_rows`: per policy, its greedy tokens and mean fraction of KV blocks
    read (over layers, steps and KV heads; 1 for dense)."""

    tokens: list[list[int]]
    kv_fractions: list[float]


def step_kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) over the last dimension of log-probabilities (clamped at 0
    against rounding), broadcasting the leading ones."""
    return (reference.exp() * (reference - other)).sum(-1).clamp_min(0)


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over steps of KL(reference || other), both `[steps, vocab]` log-probabilities
    (NaN without steps)."""
    if reference.shape[0] == 0:
        return float("nan")
    return float(step_kl(reference, other).mean())


def greedy_decode(
    model, tokenizer, prompt: str, policy: DecodePolicy, max_new_tokens: int = 32
) -> Decoded:
    """One prompt, one policy: the simple entry point."""
    s = Session(model, tokenizer)
    s.extend(tokenizer(prompt)["input_ids"])
    return s.decode(policy, max_new_tokens, stop_ids={tokenizer.eos_token_id})
