"""The only package that touches SGLang: flags, hooks, the attention backend and the
KV-store wiring behind `--sparse-mode psa`. Everything else in sglang_psa works
without SGLang installed."""
