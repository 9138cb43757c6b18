"""scripts/gpu_tests.py: the GPU suite over several budgeted calls, on a stand-in suite."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_tests.py"

PAIR = """
    import pathlib, time, pytest
    @pytest.mark.gpu
    def test_runs_beside_the_other():
        pathlib.Path("pair_{me}").touch()
        end = time.time() + 15
        while not pathlib.Path("pair_{other}").exists():
            assert time.time() < end, "ran alone"
            time.sleep(0.05)
"""
SUITE = {
    "pytest.ini": """
        [pytest]
        markers =
            gpu: stand-in
    """,
    "test/e2e/test_slow.py": """
        import time, pytest
        pytestmark = pytest.mark.gpu
        def test_fails_before_the_hang():  # pytest's summary never comes: the run is cut
            assert False, "seen before the cut"
        def test_hangs():  # and leaves a server of its own session behind
            import subprocess, sys
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                     start_new_session=True)
            open("server.pid", "a").write(str(child.pid) + " ")
            time.sleep(60)
        def test_after_the_hang():
            pass
    """,
    "test/unit/test_broken.py": """
        import pytest
        import no_such_module_here
        pytestmark = pytest.mark.gpu
        def test_never_runs():
            pass
    """,
    "test/reliability/test_crash.py": """
        import os, subprocess, sys, pytest
        pytestmark = pytest.mark.gpu
        def test_kills_pytest():  # as a dying in-process engine's scheduler does
            subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('why it died')"])
            os._exit(3)
        def test_after_the_crash():
            pass
    """,
    # kernel and unit files run at once: each passes only if the other runs beside it
    "test/kernels/test_pair_a.py": PAIR.format(me="a", other="b"),
    "test/unit/test_pair_b.py": PAIR.format(me="b", other="a"),
    "test/kernels/test_k.py": """
        import pytest
        @pytest.mark.gpu
        def test_ok():
            pass
        @pytest.mark.gpu
        def test_wrong():
            assert 1 == 2, "one is not two"
        @pytest.mark.gpu
        def test_no_device():
            pytest.skip("needs two GPUs")
        def test_cpu_only():
            pass
        @pytest.mark.gpu
        @pytest.mark.parametrize("flags", ["--a 1", "--b 2 --c"])  # ids with spaces
        def test_spaced(flags):
            assert flags != "--b 2 --c", "spaced out"
    """,
}


def _write(root: Path, files: dict[str, str]) -> Path:
    """`files` (path: text, dedented) under `root`."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


@pytest.fixture
def suite(tmp_path):
    return _write(tmp_path / "suite", SUITE)


def _call(suite: Path, tmp: Path, budget: float, commit: str = "c1", *extra: str, paths=("test",)):
    """One call of the script on `suite` (its `paths`), its state and results under `tmp`."""
    cmd = [sys.executable, str(SCRIPT), *paths, "--root", str(suite), "--budget-s", str(budget),
           "--state", str(tmp / "state"), "--out", str(tmp / "out"), "--min-left-s", "1",
           *extra]  # fmt: skip
    env = {"GIT_COMMIT": commit, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    return proc.returncode, json.loads((tmp / "out" / "gpu_tests.json").read_text())


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
def test_calls_resume_where_the_last_stopped_and_a_twice_cut_test_is_a_timeout(suite, tmp_path):
    # first call: kernels run to their end (before e2e); the hang is cut by the budget
    code, doc = _call(suite, tmp_path, 20)
    assert doc["collected"] == 13  # the CPU-only test is not the GPU suite's
    assert doc["counts"] == {"passed": 4, "failed": 3, "skipped": 1, "error": 3, "pending": 2}
    crashed = {k: doc["failed"].pop(k) for k in list(doc["failed"]) if "test_crash" in k}
    assert len(crashed) == 2  # the crash and the test pytest never reached after it
    assert all(m.startswith("pytest ended without running it") for m in crashed.values())
    # what the dying test's child wrote is in the log those messages point to
    assert (
        "why it died"
        in (tmp_path / "out/gpu_tests/test__reliability__test_crash.py.log").read_text()
    )
    assert doc["failed"] == {
        "test/kernels/test_k.py::test_wrong": "AssertionError: one is not two",
        "test/kernels/test_k.py::test_spaced[--b 2 --c]": "AssertionError: spaced out",
        # a module that does not import: its error, under the module's name
        "test/unit/test_broken.py::<collection>": "ModuleNotFoundError: No module named "
        "'no_such_module_here'",
        # written as it failed: the cut run never printed its summary
        "test/e2e/test_slow.py::test_fails_before_the_hang": "AssertionError: seen before the "
        "cut / assert False",
    }
    assert doc["skipped"] == {"test/kernels/test_k.py::test_no_device": "needs two GPUs"}
    assert code == 1  # a failure outranks what is still pending
    assert (tmp_path / "out" / "gpu_tests" / "test__kernels__test_k.py.log").exists()
    report = tmp_path / "out" / "gpu_tests" / "test__e2e__test_slow.py.failures.jsonl"
    assert "assert False" in json.loads(report.read_text())["report"]
    for pid in map(int, (suite / "server.pid").read_text().split()):  # killed at the cut
        assert not _alive(pid), pid
    # second call: only the e2e file's tests again; the hang cut a second time
    code, doc = _call(suite, tmp_path, 8)
    assert doc["counts"]["timeout"] == 1 and doc["pending"] == 1
    assert "test/e2e/test_slow.py::test_hangs" in doc["failed"]
    # third call: the rest runs; the failure before the cut is not run again
    code, doc = _call(suite, tmp_path, 30)
    assert doc["pending"] == 0 and doc["counts"]["passed"] == 5 and doc["counts"]["failed"] == 3
    secs = doc["files"]["test/kernels/test_k.py"]["seconds"]
    assert secs > 0
    # asked to: the failures again (the kernel file's two), the passes not
    code, doc = _call(suite, tmp_path, 8, "c1", "--rerun-failed")
    assert doc["files"]["test/kernels/test_k.py"]["seconds"] > secs
    assert "test/kernels/test_k.py::test_wrong" in doc["failed"] and doc["counts"]["passed"] >= 4


@pytest.mark.slow
def test_a_fresh_machine_resumes_the_state_brought_back_and_reruns_only_changed_files(tmp_path):
    root = tmp_path / "suite"
    files = {
        "pytest.ini": "[pytest]\nmarkers =\n    gpu: stand-in\n",
        "python/product.py": "X = 1\n",
        "python/serving.py": "Z = 1\n",
        "benchmark/tool.py": "Y = 1\n",
        "test/kernels/test_a.py": """
            import pytest
            @pytest.mark.gpu
            def test_counts_its_runs():  # keyed on what it imports (a kernels file)
                if False:
                    import product  # noqa: F401
                with open("runs_a", "a") as f:
                    f.write("x")
        """,
        "test/e2e/test_b.py": """
            import pathlib, time, pytest
            @pytest.mark.gpu
            def test_hangs_while_told_to():  # (it would load benchmark/tool.py)
                with open("runs_b", "a") as f:
                    f.write("x")
                if pathlib.Path("hang").exists():  # not a source file: no new suite
                    time.sleep(60)
        """,
    }
    _write(root, files)
    (root / "hang").touch()
    runs = lambda: ((root / "runs_a").read_text(), (root / "runs_b").read_text())  # noqa: E731

    def session(n: int, budget: float) -> dict:
        seed = tmp_path / f"s{n - 1}" / "out" / "gpu_tests_state.json"
        extra = ("--seed-state", str(seed)) if n > 1 else ()
        return _call(root, tmp_path / f"s{n}", budget, f"c{n}", *extra)[1]

    # session 1: the kernel file passes, the e2e file is cut by the budget
    doc = session(1, 8)
    assert doc["counts"] == {"passed": 1, "pending": 1} and runs() == ("x", "x")
    # session 2, another commit of the same sources, a fresh machine (no state): resumed
    (root / "hang").unlink()
    doc = session(2, 30)
    assert doc["counts"] == {"passed": 2} and doc["pending"] == 0
    assert doc["git_commits"] == ["c1", "c2"] and doc["git_commit"] == "c2"
    assert runs() == ("x", "xx")  # the kernel file did not run again
    # session 3: one test file changed: it alone runs again
    with (root / "test/kernels/test_a.py").open("a") as f:
        f.write("# changed\n")
    doc = session(3, 30)
    assert doc["counts"] == {"passed": 2} and runs() == ("xx", "xx")
    assert doc["git_commits"] == ["c1", "c2", "c3"]
    # session 4: the product changed: every file again, the commits before it gone
    (root / "python/product.py").write_text("X = 2\n")
    doc = session(4, 30)
    assert doc["counts"] == {"passed": 2} and runs() == ("xxx", "xxx")
    assert doc["git_commits"] == ["c4"]
    # session 5: benchmark code changed: only the file that names it runs again
    (root / "benchmark/tool.py").write_text("Y = 2\n")
    doc = session(5, 30)
    assert doc["counts"] == {"passed": 2} and runs() == ("xxx", "xxxx")
    assert doc["versions"]["sglang"] and set(doc["versions"]) == {"sglang", "torch", "triton"}
    # session 6: the state came from another SGLang release: every file again
    seed = tmp_path / "s5" / "out" / "gpu_tests_state.json"
    state = json.loads(seed.read_text())
    state["versions"]["sglang"] = "0.0.1"
    seed.write_text(json.dumps(state))
    doc = session(6, 30)
    assert doc["counts"] == {"passed": 2} and runs() == ("xxxx", "xxxxx")
    assert doc["git_commits"] == ["c6"] and doc["versions"]["sglang"] != "0.0.1"
    # session 7: product code the kernels file does not import: the other file alone again
    (root / "python/serving.py").write_text("Z = 2\n")
    doc = session(7, 30)
    assert doc["counts"] == {"passed": 2} and runs() == ("xxxx", "xxxxxx")


def test_first_runs_the_named_files_before_the_kernels(tmp_path):
    root = tmp_path / "suite"
    order = "import pytest\n@pytest.mark.gpu\ndef test_x():\n    open('order', 'a').write('{}')\n"
    _write(root, {
        "pytest.ini": "[pytest]\nmarkers =\n    gpu: stand-in\n",
        "test/kernels/test_k.py": order.format("k"),
        "test/unit/test_u.py": order.format("u"),
        "test/reliability/test_r.py": order.format("r"),
        "test/e2e/test_e.py": order.format("e"),
    })  # fmt: skip
    code, doc = _call(root, tmp_path, 60, "c1", "--first", "test/e2e/", "--jobs", "1")
    assert code == 0 and doc["counts"] == {"passed": 4}
    assert (root / "order").read_text() == "ekur"  # e2e first, then in the usual order
    (root / "order").unlink()
    first = ("--first", "test/e2e/test_e.py", "--first", "test/reliability/", "--jobs", "1")
    code, doc = _call(root, tmp_path / "again", 60, "c1", *first)
    assert code == 0 and (root / "order").read_text() == "erku"  # in --first's order


def test_a_call_on_some_paths_keeps_the_outcomes_of_the_others(tmp_path):
    root = tmp_path / "suite"
    order = "import pytest\n@pytest.mark.gpu\ndef test_x():\n    open('order', 'a').write('{}')\n"
    # a module fixture that takes a second, and a child process that writes between the
    # test's id and its outcome word (as an in-process engine's scheduler does)
    slow = (
        "import subprocess, sys, time, pytest\n@pytest.fixture(scope='module')\n"
        "def server():\n    time.sleep(1)\n"
        "    subprocess.run([sys.executable, '-c', 'print(1234)'])\n"
    )
    _write(root, {
        "pytest.ini": "[pytest]\nmarkers =\n    gpu: stand-in\n",
        "test/kernels/test_k.py": order.format("k"),
        "test/e2e/test_e.py": slow + order.format("e").replace("test_x()", "test_x(server)"),
    })  # fmt: skip
    code, doc = _call(root, tmp_path / "s1", 60, "c1")
    assert code == 0 and doc["counts"] == {"passed": 2} and (root / "order").read_text() == "ke"
    # each test's seconds, its module fixture's setup in them, slowest first
    assert list(doc["test_seconds"]) == [
        "test/e2e/test_e.py::test_x",
        "test/kernels/test_k.py::test_x",
    ]
    assert 1.0 <= doc["test_seconds"]["test/e2e/test_e.py::test_x"] < 5
    # the next machine, one file changed and only its folder named: it alone runs
    with (root / "test/e2e/test_e.py").open("a") as f:
        f.write("# changed\n")
    seed = ("--seed-state", str(tmp_path / "s1" / "out" / "gpu_tests_state.json"))
    code, doc = _call(root, tmp_path / "s2", 60, "c2", *seed, paths=("test/e2e",))
    assert code == 0 and doc["collected"] == 1 and doc["counts"] == {"passed": 1}
    assert set(doc["files"]) == {"test/e2e/test_e.py"}
    assert (root / "order").read_text() == "kee"
    # then the whole suite: the kernel file's outcome of the first call still holds
    seed = ("--seed-state", str(tmp_path / "s2" / "out" / "gpu_tests_state.json"))
    code, doc = _call(root, tmp_path / "s3", 60, "c3", *seed)
    assert code == 0 and doc["collected"] == 2 and doc["counts"] == {"passed": 2}
    assert (root / "order").read_text() == "kee"


def test_a_long_kernel_file_runs_in_parts_side_by_side(tmp_path):
    """Over `--split-over` pending tests a kernel file runs in parts at once: every test
    here passes only while a test of the other part runs."""
    root = tmp_path / "suite"
    waits = """
        import pathlib, time, pytest
        @pytest.mark.gpu
        @pytest.mark.parametrize("me", [0, 1, 2, 3])
        def test_meets(me):  # parts take every other test: 0 and 2, 1 and 3
            pathlib.Path(f"here_{me}").touch()
            other = me + 1 if me % 2 == 0 else me - 1
            end = time.time() + 15
            while not pathlib.Path(f"here_{other}").exists():
                assert time.time() < end, "ran alone"
                time.sleep(0.05)
    """
    _write(root, {"pytest.ini": "[pytest]\nmarkers =\n    gpu: stand-in\n",
                  "test/kernels/test_long.py": waits})  # fmt: skip
    code, doc = _call(root, tmp_path / "s1", 60, "c1", "--split-over", "2")
    assert code == 0 and doc["counts"] == {"passed": 4}, doc
    logs = sorted(f.name for f in (tmp_path / "s1" / "state" / "logs").glob("*.log"))
    assert logs == ["test__kernels__test_long.py.1.log", "test__kernels__test_long.py.2.log"]


def test_server_files_that_share_the_gpu_run_side_by_side_the_others_alone(tmp_path):
    """With --server-jobs 2 the two reliability files that declare SERVERS_SHARE_THE_GPU
    run at once (each passes only beside the other); the undeclared one runs alone, after."""
    root = tmp_path / "suite"
    alone = """
        import pathlib, pytest
        @pytest.mark.gpu
        def test_alone():
            assert pathlib.Path("pair_a").exists() and pathlib.Path("pair_b").exists()
    """
    _write(root, {
        "pytest.ini": "[pytest]\nmarkers =\n    gpu: stand-in\n",
        "test/reliability/test_a.py": textwrap.dedent(PAIR).replace(
            "import pathlib", "SERVERS_SHARE_THE_GPU = True\nimport pathlib").format(me="a", other="b"),
        "test/reliability/test_b.py": textwrap.dedent(PAIR).replace(
            "import pathlib", "SERVERS_SHARE_THE_GPU = True\nimport pathlib").format(me="b", other="a"),
        "test/reliability/test_c.py": alone,
    })  # fmt: skip
    code, doc = _call(root, tmp_path / "s1", 60, "c1", "--server-jobs", "2")
    assert code == 0 and doc["counts"] == {"passed": 3}, doc
    # one at a time (the default): the first of the pair waits for the other in vain
    for f in root.glob("pair_*"):
        f.unlink()
    code, doc = _call(root, tmp_path / "s2", 60, "c1")
    assert list(doc["failed"]) == ["test/reliability/test_a.py::test_runs_beside_the_other"]
    assert "ran alone" in doc["failed"]["test/reliability/test_a.py::test_runs_beside_the_other"]


def test_a_dry_run_says_which_files_keep_their_outcomes_and_runs_nothing(tmp_path):
    root = tmp_path / "suite"
    order = "import pytest\n@pytest.mark.gpu\ndef test_x():\n    open('order', 'a').write('{}')\n"
    _write(root, {
        "pytest.ini": "[pytest]\nmarkers =\n    gpu: stand-in\n",
        "python/product.py": "X = 1\n",
        "test/kernels/test_k.py": order.format("k"),
        "test/e2e/test_e.py": order.format("e"),
    })  # fmt: skip
    assert _call(root, tmp_path / "s1", 60, "c1")[1]["counts"] == {"passed": 2}
    (root / "python/product.py").write_text("X = 2\n")  # the e2e file's key holds the product
    seed = tmp_path / "s1" / "out" / "gpu_tests_state.json"
    cmd = [sys.executable, str(SCRIPT), "test", "--root", str(root), "--dry-run",
           "--state", str(tmp_path / "s2"), "--seed-state", str(seed)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "test/e2e/test_e.py: runs again (its outcomes {'passed': 1} are void)" in proc.stdout
    assert "test/kernels/test_k.py: kept {'passed': 1}" in proc.stdout
    assert "1 passed outcome(s) void" in proc.stdout
    assert (root / "order").read_text() == "ke"  # nothing ran


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_tests_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_test_file_is_keyed_on_the_benchmark_code_its_paths_reach(tmp_path):
    g = _script()
    root = tmp_path / "suite"
    files = {
        "python/product.py": "X = 1\n",
        "benchmark/reliability/probes.py": 'EX = ROOT / "examples" / "fork.py"\n',
        "benchmark/serving/run.py": "R = 1\n",
        "benchmark/store/bench.py": 'sys.path.insert(0, str(HERE.parents[1] / "kernels"))\n',
        "benchmark/kernels/timing.py": "T = 1\n",
        "examples/fork.py": "F = 1\n",
        "test/reliability/test_r.py": 'sys.path.insert(0, str(ROOT / "benchmark" / "reliability"))\n',
        "test/unit/test_s.py": "# runs benchmark/serving/run.py\n",
        "test/unit/test_st.py": "# the store benchmark's tool: benchmark/store/bench.py\n",
        "test/unit/test_prose.py": "# the benchmark's numbers, the examples' texts\n",
    }
    _write(root, files)
    assert g.named_refs(root, files["test/reliability/test_r.py"]) == {"benchmark/reliability"}
    assert g.named_refs(root, files["test/unit/test_prose.py"]) == set()
    assert g.named_refs(root, '(tmp / "benchmark").mkdir()') == {"benchmark"}
    assert g.named_refs(root, "see benchmark/nothing.py") == {"benchmark"}  # no such entry
    assert g.named_refs(root, "os.path.join(ROOT, 'benchmark', 'serving')") == {"benchmark/serving"}
    # what the named code names in turn: a path to examples/, a sibling by its quoted name
    assert g.named_code(root, {"benchmark/reliability"}) == [
        "benchmark/reliability", "examples/fork.py",
    ]  # fmt: skip
    assert g.named_code(root, {"benchmark/store"}) == ["benchmark/kernels", "benchmark/store"]
    assert g.named_code(root, {"benchmark", "benchmark/serving"}) == [
        "benchmark",
        "examples/fork.py",
    ]

    def keys():
        return g.file_keys(root, ["test"])[1]

    k0 = keys()
    for path, rerun in [
        ("benchmark/serving/run.py", {"test/unit/test_s.py"}),
        ("examples/fork.py", {"test/reliability/test_r.py"}),
        ("benchmark/kernels/timing.py", {"test/unit/test_st.py"}),
        ("python/product.py", set(k0)),
    ]:
        (root / path).write_text((root / path).read_text() + "# changed\n")
        k1 = keys()
        assert {f for f in k0 if k0[f] != k1[f]} == rerun, path
        k0 = k1
