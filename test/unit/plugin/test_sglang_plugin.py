"""The plugin against the real SGLang source (0.5.17 or 0.5.23), on CPU: entry-point discovery,
flags in --help, ServerArgs adjustments, incompatible flags named, every hook target
present with the expected signature, and no change at all without --sparse-mode.

SGLang hooks patch classes for the life of a process, so anything that loads the
plugin runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip(
    "sglang.srt.server_args",
    reason="SGLang is not installed here (bash scripts/install_sglang_cpu.sh)",
)

from sglang_psa import releases  # noqa: E402
from sglang_psa.plugin import hooks  # noqa: E402

pytestmark = pytest.mark.sglang  # SGLang's own modules: CI runs these on every release


def _run(code: str, env: dict | None = None, timeout: int = 240) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_hook_target_exists_with_its_signature():
    hooks.check_targets()


def test_a_changed_sglang_fails_with_a_clear_message(monkeypatch):
    gone = hooks.Hook("sglang.srt.server_args.ServerArgs.no_such_method", "after", "x:y", (), "")
    monkeypatch.setattr(hooks, "HOOKS", (gone,))
    with pytest.raises(hooks.SGLangChanged, match=f"no_such_method.*sglang=={releases.release()}"):
        hooks.check_targets()
    moved = hooks.Hook(
        "sglang.srt.server_args.ServerArgs.add_cli_args", "after", "x:y", ("parser", "extra"), ""
    )
    monkeypatch.setattr(hooks, "HOOKS", (moved,))
    with pytest.raises(hooks.SGLangChanged, match=r"expects \['parser', 'extra'\]"):
        hooks.check_targets()
    monkeypatch.setattr(hooks, "HOOKS", ())
    renamed = releases.Read(
        "req.row", "sglang.srt.managers.schedule_batch.Req", "no_such_field", releases.SUPPORTED
    )
    monkeypatch.setattr(releases, "READS", (renamed,))
    with pytest.raises(hooks.SGLangChanged, match="'no_such_field' of .*Req \\(req.row\\)"):
        hooks.check_targets()


@pytest.mark.parametrize("other", releases.SUPPORTED)
def test_each_supported_release_has_its_table_and_only_its_own_passes(monkeypatch, other):
    """The table of every supported release is complete (every hook function exists, every
    moved attribute is named), and the table of another release fails here, naming what
    moved: the checks tell the releases apart."""
    for hook in hooks.HOOKS:
        assert callable(hooks.hook_function(hook)), hook.fn
    monkeypatch.setattr(releases, "release", lambda version=None: other)
    releases.forget()
    try:
        for key in ("req.row", "req.prefix", "adder.total_offset", "adder.current_offset",
                    "release.insert"):  # fmt: skip
            releases.path(key)  # read by code every release runs: each release says where
        if other == releases.installed_version():
            hooks.check_targets()
        else:
            with pytest.raises(hooks.SGLangChanged, match=f"table of sglang=={other}"):
                hooks.check_targets()
    finally:
        releases.forget()


@pytest.mark.parametrize(
    "version, table",
    [("0.5.17", "0.5.17"), ("0.5.20", "0.5.17"), ("0.5.23", "0.5.23"), ("0.5.24", "0.5.23"),
     ("0.5.9", "0.5.17"), ("0.6.0", "0.5.23")],
)  # fmt: skip
def test_an_unlisted_release_uses_the_newest_supported_table_before_it(version, table):
    assert releases.release(version) == table


# ServerArgs' fields: a dataclass's (0.5.17), a msgspec Struct's (0.5.23).
FIELDS = """
def field_names(sa):
    import dataclasses
    if dataclasses.is_dataclass(sa):
        return [f.name for f in dataclasses.fields(sa)]
    import msgspec
    return [f.name for f in msgspec.structs.fields(sa)]

def fields(sa):
    return {name: repr(getattr(sa, name)) for name in field_names(sa)}
"""

SCENARIOS = (
    FIELDS
    + """
import json
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang_psa import releases
from sglang.srt.entrypoints.engine import Engine
from sglang.srt.server_args import ServerArgs, prepare_server_args

class Launched(Exception):
    pass

def launch(*args, server_args=None, **kwargs):
    raise Launched(server_args)

def engine_args(**kwargs):
    \"\"\"The ServerArgs `sgl.Engine(**kwargs)` would hand its processes (none started).\"\"\"
    Engine._launch_subprocesses = staticmethod(launch)
    try:
        Engine(**kwargs)
    except Launched as e:
        return e.args[0]

def err(argv):
    import contextlib, io
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf):
            prepare_server_args(["--model-path", "dummy", *argv])
    except SystemExit as e:
        return f"SystemExit({e.code}): {buf.getvalue()}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None

def err_env(env, argv):
    import os
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return err(argv)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

sa = prepare_server_args(["--model-path", "dummy", "--sparse-mode", "psa",
                          "--psa-threshold", "0.9", "--psa-ws-window", "4"])
eng = engine_args(model_path="dummy", sparse_mode="topk", psa_topk_tokens=1024,
                  attention_backend="torch_native")
plain = prepare_server_args(["--model-path", "dummy"])
tiered = prepare_server_args(["--model-path", "dummy", "--sparse-mode", "psa",
                              "--psa-kv-home", "tiered"])
tiered_off = prepare_server_args(["--model-path", "dummy", "--sparse-mode", "psa",
                                  "--psa-kv-home", "tiered", "--disable-radix-cache"])
has_radix = "radix_cache_backend" in field_names(plain) and releases.has("psa_radix_cache")
radix_args = ["--model-path", "dummy", "--sparse-mode", "psa", "--psa-kv-home", "tiered",
              "--radix-cache-backend", "psa"]
radix = prepare_server_args(radix_args) if has_radix else None
radix_fa3 = (
    prepare_server_args([*radix_args, "--prefill-attention-backend", "fa3"]) if has_radix else None
)
from sglang.srt.mem_cache import registry
graphs = lambda a: [a.cuda_graph_backend_decode, a.cuda_graph_backend_prefill]
print(json.dumps({
    "cli": [sa.page_size, sa.decode_attention_backend, sa.prefill_attention_backend,
            sa._psa_config.threshold, sa._psa_config.ws_window, sa.chunked_prefill_size],
    "graphs": {"psa": graphs(sa), "plain": graphs(plain), "tiered": graphs(tiered)},
    "radix": [[bool(a.disable_radix_cache), a.radix_cache_backend]
              for a in (sa, tiered, tiered_off)],
    "psa_radix": None if radix is None else [
        bool(radix.disable_radix_cache), radix.radix_cache_backend, radix.prefill_attention_backend,
        "psa" in registry.registered_radix_cache_backends(),
        radix_fa3.radix_cache_backend, radix_fa3.prefill_attention_backend,
    ],
    "engine": [eng.page_size, eng.decode_attention_backend, eng.prefill_attention_backend,
               eng._psa_config.sparse_mode, eng._psa_config.topk_tokens],
    "plain": fields(plain), "plain_has_cfg": hasattr(plain, "_psa_config"),
    "errors": {
        "spec": err(["--sparse-mode", "psa", "--speculative-algorithm", "EAGLE"]),
        "mixed": err(["--sparse-mode", "psa", "--enable-mixed-chunk"]),
        "dp_attention": err(["--sparse-mode", "psa", "--tp", "2", "--dp", "2",
                             "--enable-dp-attention"]),
        "attn_dp": err(["--sparse-mode", "psa", "--tp", "2", "--attn-dp-size", "2"])
        if "attn_dp_size" in field_names(plain) else None,
        "pp": err(["--sparse-mode", "psa", "--pp-size", "2"]),
        "page": err(["--sparse-mode", "psa", "--page-size", "16"]),
        "decode": err(["--sparse-mode", "psa", "--decode-attention-backend", "triton"]),
        "threshold": err(["--sparse-mode", "psa", "--psa-threshold", "2"]),
        "knob_alone": err(["--psa-threshold", "0.9"]),
        "radix_hbm": err(["--sparse-mode", "psa", "--radix-cache-backend", "psa"]),
        "glue": err_env({"SGLANG_ENABLE_METADATA_GLUE_GRAPH": "1"}, ["--sparse-mode", "psa"]),
        "radix_release": err(["--sparse-mode", "psa", "--psa-kv-home", "tiered",
                              "--radix-cache-backend", "psa"]),
        "radix_disabled": err(["--sparse-mode", "psa", "--psa-kv-home", "tiered",
                          "--radix-cache-backend", "psa", "--disable-radix-cache"]),
        "radix_other": err(["--sparse-mode", "psa", "--psa-kv-home", "tiered",
                            "--radix-cache-backend", "other"]),
    },
}))
"""
)


@pytest.fixture(scope="module")
def scenarios() -> dict:
    return _run(SCENARIOS)


def test_cli_and_engine_arguments_set_what_psa_needs(scenarios):
    assert scenarios["cli"] == [32, "psa", "triton", 0.9, 4, 8192]
    assert scenarios["engine"] == [32, "psa", "torch_native", "topk", 1024]


def test_cuda_graphs_stay_sglangs_at_every_kv_home(scenarios):
    """The plugin leaves SGLang's per-phase graph choices alone at every KV home (SGLang
    resolves its defaults later: decode graphs on a GPU)."""
    graphs = scenarios["graphs"]
    assert graphs["psa"] == graphs["plain"] == graphs["tiered"] == [None, None]


psa_radix = pytest.mark.skipif(
    not releases.has("psa_radix_cache"),
    reason=f"the psa radix cache is not offered on SGLang {releases.release()}",
)


@psa_radix
def test_the_tiered_home_keeps_prefix_caching_on_the_psa_radix_cache_by_default(scenarios):
    """The hbm home keeps SGLang's own prefix cache (no backend named); the tiered home,
    whose pages may leave HBM, gets the `psa` backend (the tree over the tiered store)
    without a flag, and `--disable-radix-cache` turns prefix caching off there."""
    assert scenarios["radix"] == [[False, None], [False, "psa"], [True, None]]


@psa_radix
def test_the_psa_radix_cache_keeps_prefix_caching_at_the_tiered_home(scenarios):
    """`--radix-cache-backend psa` (registered by the plugin) leaves SGLang's radix cache
    on at the tiered home, whatever the prefill backend (here triton, SGLang's choice
    without a GPU, and fa3 as given: host-only prefixes are staged on a Triton backend
    built beside it)."""
    assert scenarios["psa_radix"] == [False, "psa", "triton", True, "psa", "fa3"]


@pytest.mark.parametrize(
    "case, flags",
    [
        ("spec", ["--sparse-mode", "--speculative-algorithm"]),
        ("mixed", ["--sparse-mode", "--enable-mixed-chunk"]),
        ("dp_attention", ["--sparse-mode", "--enable-dp-attention"]),
        pytest.param(
            "attn_dp",
            ["--sparse-mode", "--attn-dp-size"],
            marks=pytest.mark.skipif(
                releases.release() == "0.5.17", reason="--attn-dp-size is SGLang 0.5.23's"
            ),
        ),
        ("pp", ["--sparse-mode", "--pp-size"]),
        ("page", ["--psa-block-size", "--page-size 16"]),
        ("decode", ["--sparse-mode", "--decode-attention-backend triton"]),
        ("threshold", ["--psa-threshold"]),
        ("glue", ["--sparse-mode", "SGLANG_ENABLE_METADATA_GLUE_GRAPH=1"]),
        ("knob_alone", ["--sparse-mode", "--psa-threshold"]),
        pytest.param(
            "radix_release",
            ["--psa-kv-home", "--radix-cache-backend psa", "needs SGLang 0.5.17 or 0.5.23"],
            marks=pytest.mark.skipif(
                releases.has("psa_radix_cache"), reason="this release has the psa radix cache"
            ),
        ),
        *(
            pytest.param(
                case, ["--psa-kv-home", "--radix-cache-backend psa", *extra], marks=psa_radix
            )
            for case, extra in (
                ("radix_hbm", ["needs --psa-kv-home tiered"]),
                ("radix_disabled", ["--disable-radix-cache"]),
                ("radix_other", ["other", "--disable-radix-cache"]),
            )
        ),
    ],
)
def test_incompatible_or_invalid_flags_fail_naming_them(scenarios, case, flags):
    """As argparse fails: one error line naming the flags, exit status 2, no traceback."""
    msg = scenarios["errors"][case]
    assert msg is not None and msg.startswith("SystemExit(2): "), msg
    line = msg.split(": ", 1)[1]
    assert line.count("\n") == 1 and ": error: " in line, msg
    for flag in flags:
        assert flag in line, (flag, msg)


def test_without_sparse_mode_sglang_is_unchanged(scenarios):
    """Every ServerArgs field equals what SGLang produces with no plugin loaded."""
    code = FIELDS + (
        "import json\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "sa = prepare_server_args(['--model-path', 'dummy'])\n"
        "print(json.dumps(fields(sa)))\n"
    )
    bare = _run(code, env={"SGLANG_PLUGINS": "no-plugin-at-all"})
    assert scenarios["plain"] == bare
    assert not scenarios["plain_has_cfg"]


def test_launch_server_help_lists_the_flags():
    """`python -m sglang.launch_server --help` finds the plugin through its entry point."""
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in (
        "--sparse-mode",
        "--psa-threshold",
        "--psa-stop-rule",
        "--psa-block-size",
        "--psa-gpu-cache-gb",
        "--psa-host-pool-gb",
        "--psa-ws-window",
        "--psa-max-inject-tokens",
        "--psa-topk-tokens",
        "--psa-kv-home",
    ):
        assert flag in out.stdout, flag
    assert "psa" in out.stdout.split("--attention-backend")[1][:2000]  # a backend choice


def test_launch_server_with_a_bad_flag_prints_one_error_line_and_starts_nothing():
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", "dummy",
         "--sparse-mode", "psa", "--psa-threshold", "2"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert "error: --psa-threshold" in last and "(0, 1]" in last, last
