"""The layering of docs/architecture.md holds: each package imports only the layers above it,
cas/guestfs/ledger stay free of trio, pyfuse3, libvirt and click, only ksfs/vm imports libvirt
and only ksfs/cli imports click.

Imports are read by parsing every module with ``ast`` (function-level and TYPE_CHECKING imports
count too); nothing is imported or run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "ksfs"

# The layer of each top-level part of ksfs (docs/architecture.md); a part may import only parts
# of a lower number.
LAYER = {
    "errors": 1, "regularfile": 1.1, "model": 1.1, "crashpoints": 1.1, "heap": 1, "progress": 1,
    "lru": 1,
    "cas": 2, "guestfs": 2.5, "ledger": 3, "vm": 4, "gateway": 5, "keeper": 6,
    "fuse": 7, "daemon": 7.5, "cli": 8, "_entry": 9,  # the command's entry point, over cli
    "ksfs": 0,  # the package itself: its __version__
}
FRAMEWORKS = ("trio", "pyfuse3", "libvirt", "click")
NEVER = {
    "errors": FRAMEWORKS, "regularfile": FRAMEWORKS, "model": FRAMEWORKS,
    "crashpoints": FRAMEWORKS, "heap": FRAMEWORKS, "progress": FRAMEWORKS, "lru": FRAMEWORKS,
    "cas": FRAMEWORKS, "guestfs": FRAMEWORKS, "ledger": FRAMEWORKS,
    "vm": ("trio", "pyfuse3", "click"),
    "gateway": ("pyfuse3", "libvirt", "click"),
    "keeper": ("pyfuse3", "click", "libvirt"),
    "fuse": ("click", "libvirt"),
    "daemon": ("click", "libvirt"),
    "cli": ("libvirt", "pyfuse3"),
    "_entry": FRAMEWORKS,
}
ONLY = {"libvirt": "vm", "click": "cli"}
# Parts of ksfs a part must not import although they sit above it: the VM controller never sees
# the store or the ledger (the keeper hands it readers), so it stays usable on its own.
NEVER_KSFS = {"vm": ("cas", "ledger", "gateway")}


def part_of(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the module."""
    found = []
    rel = path.relative_to(PKG.parent).with_suffix("")
    package = list(rel.parts[:-1])  # the package a relative import starts from
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name == "ksfs":  # from ksfs import progress: each name is a part of ksfs,
                # but for __version__, the package's own (ksfs/__init__.py: nothing else)
                found += [(node.lineno, "ksfs" if a.name == "__version__" else f"ksfs.{a.name}")
                          for a in node.names]
                continue
            found.append((node.lineno, name))
    return found


MODULES = sorted(p for p in PKG.rglob("*.py") if part_of(p) != "__init__")


def test_every_part_has_a_layer() -> None:
    parts = {part_of(p) for p in MODULES}
    assert parts <= set(LAYER), f"parts with no layer in this test: {parts - set(LAYER)}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG.parent)))
def test_imports_follow_the_layers(path: Path) -> None:
    part = part_of(path)
    problems = []
    for line, name in imports(path):
        top = name.split(".")
        if top[0] == "ksfs":
            target = top[1] if len(top) > 1 else "ksfs"
            if target != part and LAYER.get(target, 99) >= LAYER[part]:
                problems.append(f"line {line}: {part} (layer {LAYER[part]}) imports {name} "
                                f"(layer {LAYER.get(target)})")
            if target in NEVER_KSFS.get(part, ()):
                problems.append(f"line {line}: {part} must never import ksfs.{target}")
            continue
        if top[0] in NEVER.get(part, ()):
            problems.append(f"line {line}: {part} must never import {top[0]}")
        if top[0] in ONLY and ONLY[top[0]] != part:
            problems.append(f"line {line}: only ksfs/{ONLY[top[0]]} may import {top[0]}")
    assert not problems, f"{path.relative_to(PKG.parent)}:\n" + "\n".join(problems)


def test_the_checker_sees_imports_inside_functions() -> None:
    # The rules above are only as good as the parser: an import inside a function counts.
    probe = PKG / "cas" / "store.py"
    names = {name for _, name in imports(probe)}
    assert "lmdb" in names and "ksfs.cas.reader" in names  # reader is imported in a method
