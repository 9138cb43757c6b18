"""A skip for want of SGLang where SGLang is installed but broken fails on a GPU machine
(test/conftest.py): the GPU tests once recorded 44 such skips as outcomes."""

from __future__ import annotations

import conftest


def _broken() -> str:
    return "RuntimeError: operator torchvision::nms does not exist"


def test_a_skip_naming_sglang_fails_on_a_gpu_where_sglang_does_not_import():
    message = conftest.hidden_sglang_failure("SGLang is not installed", True, _broken)
    assert message is not None
    assert "SGLang is not installed" in message and "torchvision::nms" in message
    # pytest's own reason for a module-level importorskip without one names the module
    assert conftest.hidden_sglang_failure(
        "could not import 'sglang.srt.entrypoints.engine': x", True, _broken
    )


def test_other_skips_and_cpu_skips_and_a_working_sglang_stand():
    assert conftest.hidden_sglang_failure("SGLang is not installed", False, _broken) is None
    assert conftest.hidden_sglang_failure("needs two GPUs", True, _broken) is None
    assert conftest.hidden_sglang_failure("SGLang is not installed", True, lambda: None) is None
