"""Copy engine and pipeline: move new KV to the host pool and needed KV into HBM slots,
off the compute stream."""

from sglang_psa.engine.copy_engine import CopyEngine, EngineDied, SaveFailed, SaveJob
from sglang_psa.engine.loader import Loader, Ticket

__all__ = ["CopyEngine", "EngineDied", "Loader", "SaveFailed", "SaveJob", "Ticket"]
