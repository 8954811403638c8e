"""The docs' table of supported architectures (docs/architectures.md) is the registry's list,
row for row, and each row names the file whose class the registry maps it to."""

import re
from pathlib import Path

from aieng.models.registry import MODEL_CLASSES

PAGE = Path(__file__).resolve().parent.parent / "docs" / "architectures.md"
ROW = re.compile(r"^\| `(\w+)` \| `models/(\w+)\.py` \|", re.MULTILINE)


def test_docs_list_exactly_the_registered_architectures():
    rows = dict(ROW.findall(PAGE.read_text()))
    assert sorted(rows) == sorted(MODEL_CLASSES)
    for architecture, module in rows.items():
        assert MODEL_CLASSES[architecture].__module__ == f"aieng.models.{module}", architecture
