"""A prompt's token ids are checked against the vocabulary at both ends, and a prompt of
no tokens is refused, under `--sparse-mode` (a negative id would index the GPU's embedding
table out of bounds; an empty prompt crashes SGLang 0.5.23's scheduler), and left to
SGLang alone without it."""

from types import SimpleNamespace

import pytest

from sglang_psa.config import PSAConfig
from sglang_psa.plugin.validation import before_validate_one_request


def _manager(cfg):
    args = SimpleNamespace(_psa_config=cfg)
    return SimpleNamespace(server_args=args, model_config=SimpleNamespace(vocab_size=100))


@pytest.mark.parametrize("bad", [-1, -7, 100, 10**9])
def test_an_id_outside_the_vocabulary_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary \[0, 100\)"):
        before_validate_one_request(_manager(PSAConfig()), None, [5, bad, 7])


def test_ids_inside_the_vocabulary_and_text_prompts_pass_unchanged():
    m = _manager(PSAConfig())
    assert before_validate_one_request(m, None, [0, 50, 99]) is None
    assert before_validate_one_request(m, None, None) is None


def test_without_sparse_mode_the_check_is_sglangs_alone(monkeypatch):
    monkeypatch.setattr("sglang_psa.plugin.validation.config_of", lambda args: None)
    assert before_validate_one_request(_manager(None), None, [-1, 5]) is None


def test_a_prompt_of_no_tokens_is_refused():
    obj = SimpleNamespace(input_embeds=None)
    with pytest.raises(ValueError, match="the prompt is empty"):
        before_validate_one_request(_manager(PSAConfig()), obj, [])


def test_a_request_of_embeddings_without_token_ids_passes():
    obj = SimpleNamespace(input_embeds=[[0.0] * 4])
    assert before_validate_one_request(_manager(PSAConfig()), obj, []) is None
