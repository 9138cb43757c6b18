"""README's headline table and docs/results.md are generated from benchmark/results/*.json:
a result file changed without regenerating them fails here."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_tables_are_current():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "results_tables.py"), "--check"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_headline_row_names_a_summary_key_its_file_has():
    sys.path.insert(0, str(ROOT / "scripts"))
    import results_tables

    for name, key, *_ in results_tables.HEADLINE:
        assert key in results_tables.load(name)["summary"], (name, key)
