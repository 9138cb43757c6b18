"""Copy engine: a helper process that moves new KV from a staging ring into the host pool."""

from sglang_psa.engine.copy_engine import CopyEngine, EngineDied, SaveJob

__all__ = ["CopyEngine", "EngineDied", "SaveJob"]
