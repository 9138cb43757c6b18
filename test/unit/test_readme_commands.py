"""README's two commands are what CI runs (`.ci/run` reads them from README with
`scripts/readme_commands.py`): the CPU install script and the test command."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _commands() -> list[str]:
    spec = importlib.util.spec_from_file_location("rc", ROOT / "scripts" / "readme_commands.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.commands((ROOT / "README.md").read_text())


def test_readme_has_the_install_and_demo_command_then_the_test_command():
    first, second = _commands()  # exactly two
    assert first == "bash scripts/install_cpu.sh && python -m sglang_psa.demo"
    assert second == "python -m pytest -q -n auto --dist loadgroup"  # pytest-xdist
    assert (ROOT / "scripts" / "install_cpu.sh").is_file()


def test_ci_runs_readme_commands_in_a_fresh_virtual_environment():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m venv" in ci and "scripts/readme_commands.py" in ci
    script = (ROOT / "scripts" / "install_cpu.sh").read_text()
    # CPU torch where its index answers, else PyPI's; then SGLang for the plugin tests.
    assert "https://download.pytorch.org/whl/cpu" in script and "install_sglang_cpu.sh" in script
