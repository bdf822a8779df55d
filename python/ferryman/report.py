"""How a benchmark or simulation prints its report: one JSON object, or ``key: value`` lines."""

from __future__ import annotations

import json
from typing import Any


def print_report(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k}: {'n/a' if v is None else v}")  # None: nothing measured
