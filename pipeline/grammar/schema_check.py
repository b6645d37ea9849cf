"""JSON schemas no finite value satisfies (a required property whose schema is the schema
itself): llguidance compiles them and the model writes `{"a": {"a": ...` until a limit. A least
fixpoint over local `$ref`s; only what is certain is reported."""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 64  # inline nesting followed; deeper schemas are assumed satisfiable


def no_finite_instance(schema: Any) -> str | None:
    refs = _local_refs(schema)
    known = dict.fromkeys(refs, False)
    changed = True
    while changed:
        changed = False
        for ref in refs:
            if not known[ref] and _finite(_resolve(schema, ref), schema, known, 0):
                known[ref] = changed = True
    if _finite(schema, schema, known, 0):
        return None
    return ("no finite JSON value satisfies the schema (a required property, a required array "
            "item or every branch refers back to its own schema)")


def _finite(node: Any, root: Any, known: dict[str, bool], depth: int) -> bool:
    if node is False:
        return False
    if not isinstance(node, dict) or depth > MAX_DEPTH:
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref in known and not known[ref]:
        return False
    sub = depth + 1
    if any(not _finite(s, root, known, sub) for s in _list(node.get("allOf"))):
        return False
    for key in ("anyOf", "oneOf"):
        branches = _list(node.get(key))
        if branches and not any(_finite(s, root, known, sub) for s in branches):
            return False
    types = node.get("type")
    if types == "object" or types == ["object"]:
        props = node.get("properties")
        props = props if isinstance(props, dict) else {}
        for name in _list(node.get("required")):
            if isinstance(name, str) and name in props and not _finite(props[name], root, known,
                                                                       sub):
                return False
    if types == "array" or types == ["array"]:
        min_items = node.get("minItems", 0)
        items = node.get("items")
        if (isinstance(min_items, int) and min_items >= 1 and isinstance(items, (dict, bool))
                and not _finite(items, root, known, sub)):
            return False
    return True


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _local_refs(schema: Any) -> list[str]:
    found: list[str] = []
    stack = [schema]
    seen = 0
    while stack and seen < 100_000:
        node = stack.pop()
        seen += 1
        if isinstance(node, dict):
            ref = node.get("$ref")
            if (isinstance(ref, str) and ref.startswith("#") and ref not in found
                    and _resolve(schema, ref) is not None):
                found.append(ref)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _resolve(schema: Any, ref: str) -> Any:
    """The node a local JSON pointer ("#", "#/$defs/x") names, or None."""
    pointer = ref[1:]
    if pointer and not pointer.startswith("/"):
        return None  # an anchor ("#name"): not followed
    node = schema
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
