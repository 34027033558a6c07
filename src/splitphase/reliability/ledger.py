"""The reliability suite's ledger: each case's measured figures, as JSON and as a README section.

Tests record what they measured (`Ledger.record`); the session writes the ledger to JSON, and
`render_section` turns that JSON into the README's "Reliability" section, so the figures there
are always the suite's, never typed in. The section sits between two markers in the README.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BEGIN = "<!-- reliability:begin (tools/reliability_report.py writes this section) -->"
END = "<!-- reliability:end -->"
GROUPS = ("load", "faults", "fault injection", "hostile input", "properties")


@dataclass
class Case:
    """One case: what it showed, and its counts."""

    group: str
    name: str
    result: str  # one line with the measured figures
    held: int = 0  # requests that ended with a full response or an explicit refusal/error
    faults: int = 0  # faults injected and survived (the server served again afterwards)
    bad_inputs: int = 0  # hostile inputs answered with the documented 4xx
    lost: int = 0  # requests with no full response and no explicit error (must be 0)
    figures: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"group must be one of {GROUPS}, got {self.group!r}")


class Ledger:
    """Cases recorded during one run."""

    def __init__(self) -> None:
        self.cases: list[Case] = []

    def record(self, group: str, name: str, result: str, **counts: Any) -> Case:
        """Add a case (counts: held, faults, bad_inputs, lost, figures)."""
        case = Case(group, name, result, **counts)
        self.cases.append(case)
        return case

    def to_json(self) -> dict[str, Any]:
        """The document `render_section` reads."""
        return {"generated_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": f"{platform.machine()}, {_cpus()} CPUs, Python "
                           f"{platform.python_version()}",
                "cases": [asdict(c) for c in self.cases]}

    def write(self, path: str | Path) -> None:
        """Write (or merge into) a JSON file: cases of the same name are replaced."""
        path = Path(path)
        doc = self.to_json()
        if path.exists():
            old = json.loads(path.read_text())
            names = {(c["group"], c["name"]) for c in doc["cases"]}
            doc["cases"] = [c for c in old.get("cases", [])
                            if (c["group"], c["name"]) not in names] + doc["cases"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2) + "\n")


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def totals(doc: dict[str, Any]) -> dict[str, int]:
    """Sums over every case."""
    keys = ("held", "faults", "bad_inputs", "lost")
    return {k: sum(int(c.get(k, 0)) for c in doc["cases"]) for k in keys}


def render_section(doc: dict[str, Any], command: str) -> str:
    """The README section (markers included) for a ledger document."""
    t = totals(doc)
    order = {g: i for i, g in enumerate(GROUPS)}
    cases = sorted(doc["cases"], key=lambda c: order.get(c["group"], len(order)))
    lines = [
        BEGIN,
        f"Written by `{command}` from the suite's own measurements "
        f"({doc['generated_utc']}, {doc['machine']}; the machine was shared with other work, "
        "so latencies are noisy; the counts are exact).",
        "",
        f"**Requests held: {t['held']:,} · faults survived: {t['faults']:,} · bad inputs "
        f"tried: {t['bad_inputs']:,} · requests lost: {t['lost']:,}**",
        "",
        "| group | case | result | held | faults | bad inputs | lost |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for c in cases:
        result = str(c["result"]).replace("|", "\\|")
        lines.append(f"| {c['group']} | {c['name']} | {result} | {c['held']} | {c['faults']} "
                     f"| {c['bad_inputs']} | {c['lost']} |")
    lines.append(END)
    return "\n".join(lines)


def replace_section(readme: str, section: str) -> str:
    """The README with its reliability section replaced (or appended under a heading)."""
    if BEGIN in readme and END in readme:
        head, rest = readme.split(BEGIN, 1)
        return head + section + rest.split(END, 1)[1]
    return readme.rstrip("\n") + "\n\n## Reliability\n\n" + section + "\n"
