"""A result file is JSON: what a run could not measure (NaN, an infinite gap) is null."""

import json

import numpy as np

from sglang_psa.eval.results import dump_result


def test_nan_and_infinity_are_written_as_null_and_the_rest_kept():
    doc = {
        "summary": {"ratio": float("nan"), "kept": 0.5, "n": 3, "name": "psa", "ok": True},
        "data": {"gaps": [1.0, float("inf"), -float("inf")], "np": np.float32("nan")},
        "pair": (np.float64(2.5), None),
    }
    text = dump_result(doc)
    back = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert back == {
        "summary": {"ratio": None, "kept": 0.5, "n": 3, "name": "psa", "ok": True},
        "data": {"gaps": [1.0, None, None], "np": None},
        "pair": [2.5, None],
    }
