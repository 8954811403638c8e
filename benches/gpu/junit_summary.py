"""Reads pytest's junit xml and fails a device run that did not truly test: any failure, error
or skip (a GPU test that skips on the GPU host tested nothing), or no test at all.

    python benches/gpu/junit_summary.py tests.xml   # prints the counts; exit 1 if not clean
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

SHOWN = 20  # failures and skips listed by name


@dataclass
class Summary:
    tests: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.tests > 0 and not self.failed and not self.skipped


def summarize(path: Path) -> Summary:
    """Every <testcase> of the report: failures and errors, skips (with their reasons)."""
    summary = Summary()
    for case in ET.parse(path).getroot().iter("testcase"):
        summary.tests += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for child in case:
            reason = f"{name}: {child.get('message', '')}".strip()
            if child.tag in ("failure", "error"):
                summary.failed.append(reason)
            elif child.tag == "skipped":
                summary.skipped.append(reason)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: junit_summary.py REPORT.xml", file=sys.stderr)
        return 2
    path = Path(args[0])
    if not path.is_file():
        print(f"junit_summary: no report at {path}: pytest did not finish", file=sys.stderr)
        return 1
    summary = summarize(path)
    print(
        f"junit_summary: {summary.tests} tests, {len(summary.failed)} failed or errors, "
        f"{len(summary.skipped)} skipped"
    )
    for label, reasons in (("FAILED", summary.failed), ("SKIPPED", summary.skipped)):
        for reason in reasons[:SHOWN]:
            print(f"  {label} {reason}")
        if len(reasons) > SHOWN:
            print(f"  ... and {len(reasons) - SHOWN} more {label.lower()} (the junit xml has all)")
    if summary.skipped:
        print("junit_summary: a test that skips on the GPU host tested nothing: the run fails")
    if summary.tests == 0:
        print("junit_summary: no test ran", file=sys.stderr)
    return 0 if summary.clean else 1


if __name__ == "__main__":
    sys.exit(main())
