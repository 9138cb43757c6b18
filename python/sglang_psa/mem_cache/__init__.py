"""HBM-tier bookkeeping of SGLang's KV pages: block metadata and working-set stamps."""
