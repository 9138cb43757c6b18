"""The --sparse-mode / --psa-* flags: derived from PSAConfig, validated with the flag's
name, carried to child processes, shown in --help."""

import argparse
import dataclasses

import pytest

from sglang_psa.config import PSAConfig, PSAConfigError, flag_name
from sglang_psa.plugin import flags


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch_server")
    flags.add_psa_args(p)
    flags.add_psa_args(p)  # idempotent: a second hook call must not raise
    return p


def test_every_config_field_has_a_flag_in_help(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for f in dataclasses.fields(PSAConfig):
        if f.name != "extra":
            assert flag_name(f.name) in out
    for name in ("--psa-ws-window", "--psa-max-inject-tokens", "--psa-topk-tokens"):
        assert name in out  # the list, by name


def test_only_given_flags_override_defaults():
    ns = _parser().parse_args(["--sparse-mode", "psa", "--psa-threshold", "0.9"])
    cfg = flags.config_from_namespace(ns)
    assert cfg == PSAConfig(threshold=0.9)
    topk = flags.config_from_namespace(
        _parser().parse_args(["--sparse-mode", "topk", "--psa-topk-tokens", "1024"])
    )
    assert topk.sparse_mode == "topk" and topk.topk_tokens == 1024


@pytest.mark.parametrize("word, want", [("1", True), ("true", True), ("off", False)])
def test_a_switch_takes_1_true_or_0_false_and_refuses_anything_else(word, want):
    argv = ["--sparse-mode", "psa", "--psa-audit-coverage"]
    assert flags.config_from_namespace(_parser().parse_args([*argv, word])).audit_coverage is want
    with pytest.raises(PSAConfigError, match="^--psa-audit-coverage .*must be 1/true or 0/false"):
        flags.config_from_namespace(_parser().parse_args([*argv, "maybe"]))


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--sparse-mode", "psa", "--psa-threshold", "1.5"], "--psa-threshold"),
        (["--sparse-mode", "psa", "--psa-bound-bits", "4"], "--psa-bound-bits"),
        (["--sparse-mode", "psa", "--psa-block-size", "24"], "--psa-block-size"),
        (["--sparse-mode", "psa", "--psa-host-pool-gb", "-1"], "--psa-host-pool-gb"),
        (["--sparse-mode", "psa", "--psa-recent-blocks", "0"], "--psa-recent-blocks"),
        (["--psa-threshold", "0.9"], "--sparse-mode"),  # a knob without the mode
        (["--sparse-mode", "none", "--psa-ws-window", "4"], "--sparse-mode"),
    ],
)
def test_invalid_values_name_the_flag(argv, flag):
    with pytest.raises(PSAConfigError) as e:
        flags.config_from_namespace(_parser().parse_args(argv))
    assert str(e.value).startswith(flag)


@pytest.mark.parametrize(
    "argv, flag, says",
    [
        (["--sparse-mode", "dense"], "--sparse-mode", "must be one of"),
        (["--sparse-mode", "psa", "--psa-threshold", "abc"], "--psa-threshold", "a number"),
        (["--sparse-mode", "psa", "--psa-ws-window", "x"], "--psa-ws-window", "an integer"),
        (["--sparse-mode", "psa", "--psa-block-size", "32.0"], "--psa-block-size", "an integer"),
        (["--sparse-mode", "psa", "--psa-kv-home", "disk"], "--psa-kv-home", "must be one of"),
    ],
)
def test_malformed_values_pass_argparse_and_fail_naming_the_flag(argv, flag, says, capsys):
    """argparse takes every value as typed: its own type and choice errors would print
    SGLang's whole usage; the config's error is one line naming the flag."""
    ns = _parser().parse_args(argv)
    assert capsys.readouterr().err == ""
    with pytest.raises(PSAConfigError) as e:
        flags.config_from_namespace(ns)
    assert str(e.value).startswith(flag) and says in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv, flag, partner",
    [
        (["--sparse-mode", "psa", "--psa-writeback", "engine"], "--psa-writeback", "--psa-kv-home"),
        (["--sparse-mode", "psa", "--psa-kv-home", "hbm", "--psa-host-pool-gb", "8"],
         "--psa-host-pool-gb", "--psa-kv-home"),
        (["--sparse-mode", "topk", "--psa-cold-fraction", "0.2"], "--psa-cold-fraction",
         "--psa-kv-home"),
        (["--sparse-mode", "psa", "--psa-topk-tokens", "1024"], "--psa-topk-tokens",
         "--sparse-mode"),
    ],
)  # fmt: skip
def test_a_flag_that_acts_only_with_another_is_refused_alone_naming_both(argv, flag, partner):
    with pytest.raises(PSAConfigError) as e:
        flags.config_from_namespace(_parser().parse_args(argv))
    msg = str(e.value)
    assert msg.startswith(flag) and f"acts only with {partner} " in msg


def test_flags_that_act_together_are_accepted_together():
    for name, (other, value) in flags.ONLY_WITH.items():
        argv = ["--sparse-mode", "psa", flag_name(other), value]
        if other == "sparse_mode":
            argv = [flag_name(other), value]
        given = {"writeback": "engine", "host_pool_gb": "8", "cold_fraction": "0.25",
                 "code_bits": "4", "unit_cache_ways": "16", "writeback_start": "0.5"}  # fmt: skip
        argv += [flag_name(name), given.get(name, "1024")]
        cfg = flags.config_from_namespace(_parser().parse_args(argv))
        assert getattr(cfg, other) == value
        assert getattr(cfg, name) != getattr(PSAConfig(), name)  # the flag took effect


def test_no_flag_means_plain_sglang_and_config_reaches_children(monkeypatch):
    monkeypatch.delenv(flags.ENV_VAR, raising=False)
    assert flags.config_from_namespace(_parser().parse_args([])) is None
    flags.export(None)
    assert flags.imported() is None
    cfg = PSAConfig(threshold=0.95, gpu_cache_gb=3.0, stop_rule="certified")
    flags.export(cfg)
    assert flags.imported() == cfg
    flags.export(None)
    assert flags.imported() is None


def test_the_host_tier_is_sized_for_the_host_and_a_size_it_cannot_give_is_refused(monkeypatch):
    """Pinned host memory is never swapped out: left out, --psa-host-pool-gb takes 40% of
    what the host has available (at most the default), in 0.5 GiB steps; given, more than
    80% of it is refused at startup naming the flag; the hbm home needs no host tier."""
    tiered = ["--sparse-mode", "psa", "--psa-kv-home", "tiered"]
    parse = lambda argv: flags.config_from_namespace(_parser().parse_args(argv))  # noqa: E731
    monkeypatch.setattr(flags, "host_memory_available_gib", lambda: 20.0)
    assert parse(tiered).host_pool_gb == 8.0
    assert parse([*tiered, "--psa-host-pool-gb", "16"]).host_pool_gb == 16.0
    with pytest.raises(PSAConfigError, match=r"^--psa-host-pool-gb .*20\.0 GiB available"):
        parse([*tiered, "--psa-host-pool-gb", "17"])
    assert parse(["--sparse-mode", "psa"]).host_pool_gb == PSAConfig().host_pool_gb
    monkeypatch.setattr(flags, "host_memory_available_gib", lambda: 500.0)
    assert parse(tiered).host_pool_gb == PSAConfig().host_pool_gb  # the default, at most
    monkeypatch.setattr(flags, "host_memory_available_gib", lambda: None)  # not Linux
    assert parse([*tiered, "--psa-host-pool-gb", "4096"]).host_pool_gb == 4096.0


def test_this_hosts_available_memory_is_read():
    import sys

    got = flags.host_memory_available_gib()
    if sys.platform.startswith("linux"):
        assert got is not None and 0 < got < 1 << 20  # GiB
    else:
        assert got is None
