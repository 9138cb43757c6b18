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


def test_a_row_is_dated_by_the_run_its_key_comes_from():
    """A key paired from several runs shows its newest run's day, not the file's (which
    moves whenever any stage is merged); a key without provenance shows the file's."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import results_tables

    doc = {
        "date": "2026-12-01T19:29:02+00:00",
        "summary_provenance": {
            "one": {"date": "2026-11-28T10:00:00+00:00"},
            "two": {"runs": [{"date": "2026-11-27T01:00:00"}, {"date": "2026-11-29T02:00:00"}]},
        },
    }
    assert results_tables.run_date(doc, "one") == "2026-11-28"
    assert results_tables.run_date(doc, "two") == "2026-11-29"
    assert results_tables.run_date(doc, "three") == "2026-12-01"


def test_a_result_with_nan_or_infinity_fails_naming_its_file(tmp_path):
    """Python writes NaN and Infinity, which are not JSON: every result file is read
    strictly, so `--check` (CI) fails on one."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import pytest
    import results_tables

    good = tmp_path / "good.json"
    good.write_text('{"summary": {"x": null}}')
    assert results_tables.read(good) == {"summary": {"x": None}}
    for token in ("NaN", "Infinity", "-Infinity"):
        bad = tmp_path / "bad.json"
        bad.write_text('{"summary": {"x": ' + token + "}}")
        with pytest.raises(SystemExit, match=f"bad.json: {token} is not JSON"):
            results_tables.read(bad)
