import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_psa.config import PSAConfig, PSAConfigError, flag_name


def test_defaults_are_valid():
    cfg = PSAConfig()
    assert cfg.block_size == 32 and cfg.ws_window == 12 and cfg.stop_rule == "heuristic"


@pytest.mark.parametrize(
    "field,value,flag",
    [
        ("threshold", 0.0, "--psa-threshold"),
        ("threshold", 1.01, "--psa-threshold"),
        ("threshold", float("nan"), "--psa-threshold"),
        ("stop_rule", "exact", "--psa-stop-rule"),
        ("sparse_mode", "dense", "--sparse-mode"),
        ("block_size", 48, "--psa-block-size"),
        ("block_size", 0, "--psa-block-size"),
        ("gpu_cache_gb", -1.0, "--psa-gpu-cache-gb"),
        ("host_pool_gb", 0, "--psa-host-pool-gb"),
        ("ws_window", 0, "--psa-ws-window"),
        ("max_inject_tokens", 2.5, "--psa-max-inject-tokens"),
        ("recent_blocks", 0, "--psa-recent-blocks"),
        ("wave_growth", 0.5, "--psa-wave-growth"),
        ("topk_tokens", 16, "--psa-topk-tokens"),
        ("kv_home", "disk", "--psa-kv-home"),
        ("unit_cache_ways", 0, "--psa-unit-cache-ways"),
        ("unit_cache_ways", 65, "--psa-unit-cache-ways"),
    ],
)
def test_invalid_value_names_its_field_and_flag(field, value, flag):
    with pytest.raises(PSAConfigError) as ei:
        PSAConfig(**{field: value})
    assert ei.value.field == field
    assert ei.value.flag == flag == flag_name(field)
    assert str(ei.value).startswith(flag)


def test_max_wave_must_cover_first_wave():
    with pytest.raises(PSAConfigError, match="--psa-max-wave-blocks"):
        PSAConfig(wave_blocks=64, max_wave_blocks=32)


@given(
    n=st.integers(0, 5000),
    first=st.integers(1, 64),
    growth=st.floats(1.0, 4.0),
    cap=st.integers(64, 512),
)
def test_wave_sizes_partition_the_blocks(n, first, growth, cap):
    sizes = PSAConfig(wave_blocks=first, wave_growth=growth, max_wave_blocks=cap).wave_sizes(n)
    assert sum(sizes) == n
    assert all(1 <= s <= cap for s in sizes)
    assert all(a <= b for a, b in zip(sizes[:-2], sizes[1:-1]))  # non-decreasing but the last


def test_a_first_wave_fraction_grows_between_its_bounds():
    cfg = PSAConfig(wave_fraction=1 / 8, max_first_wave_blocks=64)
    assert [cfg.first_wave(n) for n in (0, 100, 128, 300, 512, 5000)] == [16, 16, 16, 37, 64, 64]
    assert PSAConfig(wave_fraction=0).first_wave(5000) == 16  # always wave_blocks
    sizes = cfg.wave_sizes(1000, cfg.first_wave(1000))
    assert sizes[0] == 64 and sum(sizes) == 1000 and max(sizes) == 128
    assert PSAConfig(max_wave_blocks=32).wave_sizes(100, 50)[:2] == [50, 50]  # never shrinks


@given(
    n=st.integers(0, 3000),
    first=st.integers(1, 200),
    later=st.integers(1, 64),
    growth=st.floats(1.0, 2.0),
)
def test_later_waves_start_small_and_grow_to_the_cap(n, first, later, growth):
    cfg = PSAConfig(later_wave_blocks=later, wave_growth=growth, max_wave_blocks=128)
    sizes = cfg.wave_sizes(n, first)
    assert sum(sizes) == n
    if n > first:
        assert sizes[0] == first and sizes[1] == min(later, n - first)
    body = sizes[1:-1]  # the later waves but the last (which takes what is left)
    assert all(a <= b <= max(128, first) for a, b in zip(body, body[1:]))
    if len(sizes) > 2:
        assert sizes[2] == min(int(min(later * growth, max(128, first))), n - first - sizes[1])


def test_later_waves_default_to_the_first_waves_size():
    cfg = PSAConfig()
    assert cfg.later_wave_blocks == 0
    assert cfg.wave_sizes(1000, 128) == [128] * 7 + [104]
    assert cfg.replace(later_wave_blocks=16).wave_sizes(300, 128) == [128, 16, 20, 25, 31, 39, 41]
    with pytest.raises(PSAConfigError, match="--psa-later-wave-blocks"):
        PSAConfig(later_wave_blocks=-1)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, float("nan")])
def test_a_read_fraction_must_be_a_share(bad):
    with pytest.raises(PSAConfigError, match="--psa-max-read-fraction"):
        PSAConfig(max_read_fraction=bad)


@pytest.mark.parametrize(
    "changes,flag",
    [
        (dict(wave_fraction=1.5), "--psa-wave-fraction"),
        (dict(wave_fraction=-0.1), "--psa-wave-fraction"),
        (dict(wave_fraction=0.1, max_first_wave_blocks=8), "--psa-max-first-wave-blocks"),
    ],
)
def test_bad_wave_fraction_settings_name_their_flag(changes, flag):
    with pytest.raises(PSAConfigError, match=flag):
        PSAConfig(**changes)
