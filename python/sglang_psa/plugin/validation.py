"""Requests checked in the launching process (SGLang's tokenizer manager), before any
reaches a scheduler.

A prompt given as token ids is checked against the vocabulary at both ends: SGLang
0.5.17 refuses ids at or past the vocabulary size but not negative ones, which index
the embedding table out of bounds on the GPU (a device-side assert takes the scheduler,
and every request it holds, down). A prompt of no tokens (an empty text where the
tokenizer adds none, or `input_ids: []`) is refused too: SGLang 0.5.17's tokenizer
refuses an empty text, 0.5.23's lets it through, and the scheduler runs it as an extend
of zero tokens, whose rotary embedding raises and takes the server down. Without
`--sparse-mode` the checks pass straight through, as every hook does.
"""

from __future__ import annotations

from sglang_psa.plugin.server_args import config_of


def before_validate_one_request(manager, obj, input_ids):
    """`TokenizerManager._validate_one_request`: a token id outside `[0, vocab)`, or a
    prompt of no tokens (`input_ids == []` without `input_embeds`), is a ValueError
    (HTTP 400) saying which; returns None (the arguments unchanged)."""
    if input_ids is None or config_of(manager.server_args) is None:
        return None
    if len(input_ids) == 0:
        if getattr(obj, "input_embeds", None) is not None:
            return None
        raise ValueError("the prompt is empty: it has no tokens (send at least one)")
    vocab = int(manager.model_config.vocab_size)
    lo, hi = min(input_ids), max(input_ids)
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"input_ids: token id {bad} is outside the vocabulary [0, {vocab}) of this model"
        )
    return None
