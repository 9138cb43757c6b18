"""The `psa` decode attention backend (graph state, per-step metadata, kernel calls)."""
