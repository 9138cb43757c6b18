"""sglang-psa: progressive sparse attention over a tiered KV store, as an SGLang add-on."""

from sglang_psa.config import PSAConfig, PSAConfigError

__all__ = ["PSAConfig", "PSAConfigError"]
__version__ = "0.1.0"
