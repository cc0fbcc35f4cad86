"""RFC 6902 JSON patches applied as the API server applies an admission webhook's answer."""

from __future__ import annotations

import copy
from typing import Any


def apply_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 add/replace/remove, enough to apply what an API server would apply."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if isinstance(parent, list):
            if op["op"] == "add":
                parent.insert(len(parent) if last == "-" else int(last), op["value"])
            elif op["op"] == "replace":
                parent[int(last)] = op["value"]
            else:
                del parent[int(last)]
        elif op["op"] in ("add", "replace"):
            assert op["op"] == "add" or last in parent, op
            parent[last] = op["value"]
        else:
            del parent[last]
    return doc
