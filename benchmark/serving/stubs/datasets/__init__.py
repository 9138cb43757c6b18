"""Client-side stand-in for Hugging Face `datasets` (not installed on the GPU host).

`sglang.benchmark.datasets` imports `load_dataset` at module load for its MMMU
and LongBench loaders; the serving benchmark uses only the `custom` JSONL
dataset, so the name only has to exist. It is put on the client's PYTHONPATH
by `benchmark/serving/driver.py`, never on the server's.
"""


def load_dataset(*args, **kwargs):
    raise RuntimeError(
        "benchmark/serving/stubs/datasets is a stub: only --dataset-name custom is supported"
    )
