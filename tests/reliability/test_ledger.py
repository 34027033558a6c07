"""The ledger renders the README section from recorded figures and merges runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from splitphase.reliability.ledger import (
    BEGIN,
    END,
    Ledger,
    render_section,
    replace_section,
    totals,
)

ROOT = Path(__file__).resolve().parents[2]


def _book() -> Ledger:
    book = Ledger()
    book.record("load", "burst", "190 done | 10 refused", held=200)
    book.record("hostile input", "bad json", "4 x 400", bad_inputs=4, held=1)
    book.record("faults", "kill", "restarted", held=3, faults=1)
    return book


def test_render_orders_groups_sums_and_escapes() -> None:
    doc = _book().to_json()
    assert totals(doc) == {"held": 204, "faults": 1, "bad_inputs": 4, "lost": 0}
    text = render_section(doc, "python tools/reliability_report.py")
    assert text.startswith(BEGIN) and text.endswith(END)
    assert "Requests held: 204" in text and "requests lost: 0" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| load", "| faults", "| hostile input"]
    assert "190 done \\| 10 refused" in text


def test_replace_section_in_place_or_appended() -> None:
    section = render_section(_book().to_json(), "cmd")
    appended = replace_section("# readme\n", section)
    assert appended.startswith("# readme\n\n## Reliability\n\n" + BEGIN)
    again = replace_section(appended.replace("204", "999") + "\ntail\n", section)
    assert again.count(BEGIN) == 1 and again.endswith("\ntail\n") and "999" not in again


def test_write_merges_cases_by_name(tmp_path: Path) -> None:
    out = tmp_path / "l.json"
    _book().write(out)
    other = Ledger()
    other.record("load", "burst", "new figure", held=5)
    other.write(out)
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 3 and [c["result"] for c in cases if c["name"] == "burst"] == [
        "new figure"]
    with pytest.raises(ValueError, match="group"):
        Ledger().record("misc", "x", "y")


def test_report_tool_renders_a_ledger_into_a_readme(tmp_path: Path) -> None:
    ledger, readme = tmp_path / "l.json", tmp_path / "README.md"
    _book().write(ledger)
    readme.write_text("# x\n\n## Reliability\n\n" + BEGIN + "\nold\n" + END + "\n\n## Next\n")
    subprocess.run([sys.executable, str(ROOT / "tools" / "reliability_report.py"), "--from",
                    str(ledger), "--readme", str(readme)], check=True, capture_output=True)
    text = readme.read_text()
    assert "old" not in text and "Requests held: 204" in text and text.endswith("## Next\n")
