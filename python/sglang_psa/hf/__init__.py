"""Run Hugging Face `transformers` causal LMs with PSA decode attention (accuracy work on CPU/GPU)."""

from sglang_psa.hf.attention import ATTN_NAME, DecodePolicy, PSARuntime, install, runtime
from sglang_psa.hf.decode import Session, greedy_decode

__all__ = [
    "ATTN_NAME",
    "DecodePolicy",
    "PSARuntime",
    "Session",
    "greedy_decode",
    "install",
    "runtime",
]
