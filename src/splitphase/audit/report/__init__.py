"""The audit report: report.json (validated against its schema), report.html and report.md."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from splitphase.audit.report.build import build_report
from splitphase.audit.report.schema import REPORT_SCHEMA, validate_report
from splitphase.errors import UserError

__all__ = ["REPORT_SCHEMA", "build_report", "validate_report", "write_report"]


def write_report(out_dir: str | Path, doc: dict[str, Any], itl_samples_s: Sequence[float]) -> Path:
    """Validate `doc` and write report.json, report.html and report.md into `out_dir`."""
    from splitphase.audit.report.html import render_html
    from splitphase.audit.report.markdown import render_markdown
    from splitphase.audit.report.plots import all_plots

    validate_report(doc)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        plots = all_plots(doc, list(itl_samples_s))
        (out / "report.html").write_text(render_html(doc, plots), encoding="utf-8")
        (out / "report.md").write_text(render_markdown(doc), encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write the report to {out}: {exc.strerror or exc}") from exc
    return out
