"""The fields the two forms of the hot path share, declared once (``hvtrace.record.hot.
PHASES_FIELDS``): the compiled ``Phases`` (``hvtrace/record/_hot/common.h``'s struct, exposed by
``Phases_members`` in ``_hot/phases.c``) and the Python fallback (``hot.Phases``) have exactly
those, in that order, and the Python hooks keep no per-step state outside them. A field added on
one side only fails here. The C sources are read as text too, so that this also holds where the
extension is not built."""

from __future__ import annotations

import ast
import inspect
import re
import types
from pathlib import Path

import pytest

from hvtrace.record import hot, native
from hvtrace.record.hot import PHASES_FIELDS

HOT_C = Path(hot.__file__).with_name("_hot.c")
PARTS = HOT_C.with_suffix("")  # hvtrace/record/_hot/: the parts _hot.c includes


def _members(cls: type) -> tuple[str, ...]:
    """The member descriptors a class defines itself (C members, or slots), in order."""
    return tuple(n for n, d in vars(cls).items() if isinstance(d, types.MemberDescriptorType))


def _block(text: str, start: str) -> str:
    """From ``start`` to the end of its braces' block."""
    i = text.index(start)
    return text[i : text.index("};", i)]


def test_the_fields_are_named_once() -> None:
    assert len(set(PHASES_FIELDS)) == len(PHASES_FIELDS)
    assert all(name.isidentifier() for name in PHASES_FIELDS)


def test_the_compiled_phases_exposes_exactly_the_shared_fields() -> None:
    if native._hot is None:
        pytest.skip("hvtrace.record._hot is not built here")
    assert _members(native._hot.Phases) == PHASES_FIELDS
    assert hot.PhasesBase is native._hot.Phases
    fresh = native._hot.Phases()  # every field readable from the start (None, 0 or False)
    assert all(getattr(fresh, name) in (None, 0) for name in PHASES_FIELDS)


def test_the_python_fallback_has_the_same_fields() -> None:
    assert hot.Phases.__slots__ is PHASES_FIELDS
    assert sorted(_members(hot.Phases)) == sorted(PHASES_FIELDS)  # (slots are laid out sorted)
    if native._hot is None:
        assert hot.PhasesBase is hot.Phases


def test_the_c_source_declares_the_same_members() -> None:
    """``Phases_members`` names exactly the shared fields, in order; every field of the struct is
    a member; every object field is in ``PHASES_OBJECTS`` (set to None, visited and cleared)."""
    phases_c = (PARTS / "phases.c").read_text()
    common_h = (PARTS / "common.h").read_text()
    table = _block(phases_c, "static PyMemberDef Phases_members[]")
    names = tuple(re.findall(r'^\s*(?:OBJ_MEMBER\(|\{)"(\w+)"', table, re.M))
    assert names == PHASES_FIELDS
    c_fields = re.findall(r"OBJ_MEMBER\(\"\w+\", (\w+),|offsetof\(Phases, (\w+)\)", table)
    c_fields = [a or b for a, b in c_fields]
    struct = common_h[common_h.index("typedef struct {\n    PyObject_HEAD") :]
    struct = struct[: struct.index("} Phases;")].split("PyObject_HEAD", 1)[1]
    declared = re.findall(r"\*?\s*(\w+)\s*[,;]", struct)
    assert sorted(declared) == sorted(c_fields)
    objects = re.findall(r"PyObject \*(.*?);", struct)
    object_fields = [f.strip().lstrip("*") for line in objects for f in line.split(",")]
    macro = common_h[common_h.index("#define PHASES_OBJECTS(X)") :]
    macro = macro[: macro.index("\n\n")]
    assert re.findall(r"X\((\w+)\)", macro) == object_fields


def test_the_python_hooks_keep_no_state_outside_the_fields() -> None:
    """What the Python hooks read and write on the tracer is a shared field, one of the hooks
    themselves, or one of the few things the tracer hands them (its own, in both forms)."""
    tracer_own = {"_poll", "poll_interval_ns", "fail", "_learn", "resync_clock"}
    hooks = {n for n, v in vars(hot.TracerHooks).items() if callable(v)}
    tree = ast.parse(inspect.getsource(hot.TracerHooks))
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }
    assert used - hooks - tracer_own <= set(PHASES_FIELDS)


def test_the_extension_is_its_parts() -> None:
    """``_hot.c`` includes every part of ``_hot/`` once (setup.py's ``depends`` and the
    Makefile's stamp name the folder's files: a part not included would be rebuilt for nothing,
    one outside it not at all)."""
    included = re.findall(r'^#include "_hot/([\w.]+)"$', HOT_C.read_text(), re.M)
    assert sorted(included) == sorted(p.name for p in PARTS.iterdir())
    assert len(included) == len(set(included)) and included[0] == "common.h"
