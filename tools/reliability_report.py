"""Run the reliability suite and write its figures into the README's "Reliability" section.

    python tools/reliability_report.py                 # pytest tests/reliability, then README
    python tools/reliability_report.py --soak-s 60     # also bench/soak.py for 60 s
    python tools/reliability_report.py --from out.json # render an existing ledger only

The suite records each case's measured figures in a ledger (SPLITPHASE_RELIABILITY_OUT); this
script renders that ledger between the README's reliability markers. Nothing is typed in:
a failing suite writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from splitphase.reliability.ledger import render_section, replace_section

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python tools/reliability_report.py"


def run_suite(ledger: Path, soak_s: float | None) -> None:
    """pytest tests/reliability (and the soak) with the ledger path set; exits if one fails."""
    env = {**os.environ, "SPLITPHASE_RELIABILITY_OUT": str(ledger), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "tests/reliability", "-q", "-p", "no:cacheprovider"]
    if subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
        sys.exit("the reliability suite failed; the README was not changed")
    if soak_s is not None:
        soak = [sys.executable, "bench/soak.py", "--duration-s", str(soak_s), "--ledger",
                str(ledger)]
        if subprocess.run(soak, cwd=ROOT, env=env).returncode != 0:
            sys.exit("the soak failed; the README was not changed")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="source", help="render this ledger JSON, run nothing")
    p.add_argument("--soak-s", type=float, help="also run bench/soak.py this many seconds")
    p.add_argument("--readme", default=str(ROOT / "README.md"))
    p.add_argument("--keep", help="also keep the ledger JSON here")
    args = p.parse_args()
    if args.source:
        doc = json.loads(Path(args.source).read_text())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            ledger = Path(tmp) / "reliability.json"
            run_suite(ledger, args.soak_s)
            doc = json.loads(ledger.read_text())
    if args.keep:
        Path(args.keep).write_text(json.dumps(doc, indent=2) + "\n")
    readme = Path(args.readme)
    command = COMMAND + (f" --soak-s {args.soak_s:g}" if args.soak_s else "")
    readme.write_text(replace_section(readme.read_text(), render_section(doc, command)))
    print(f"wrote the reliability section of {readme} ({len(doc['cases'])} cases)")


if __name__ == "__main__":
    main()
