"""README's table of supported architectures is the registry's list, row for row, and each row
names the file whose class the registry maps it to."""

import re
from pathlib import Path

from aieng.models.registry import MODEL_CLASSES

README = Path(__file__).resolve().parent.parent / "README.md"
ROW = re.compile(r"^\| `(\w+)` \| `models/(\w+)\.py` \|", re.MULTILINE)


def test_readme_lists_exactly_the_registered_architectures():
    section = README.read_text().split("## Supported architectures", 1)[1].split("\n## ", 1)[0]
    rows = dict(ROW.findall(section))
    assert sorted(rows) == sorted(MODEL_CLASSES)
    for architecture, module in rows.items():
        assert MODEL_CLASSES[architecture].__module__ == f"aieng.models.{module}", architecture
