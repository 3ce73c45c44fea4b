"""Address-space-strict check of the .metal sources, on any machine.

The emulator erases Metal's address spaces, so a kernel that passes a
threadgroup pointer where a device pointer is expected runs there and fails
in Apple's compiler. This check parses each .metal file as C++ for OpenCL
through the libclang wheel (PyPI), where MSL's four address spaces map to
OpenCL's: every mismatched pointer or reference conversion is a compile
error. A second pass walks the AST for unqualified pointers, which OpenCL
reads as its generic address space and MSL has no such thing (an unqualified
pointer there means `thread`).

Two check-only rewrites are made on a copy of the sources (prepare()): the
instantiation macro loses ``[[host_name]] [[kernel]]``, and kernel-scope
``threadgroup T a[N];`` arrays become pointers from a declaration-only helper
(C++ for OpenCL allows no local-address-space variables outside kernels).

Not checked: Metal attribute rules, member functions' `this` address space,
real `metal::` signatures beyond strict/metal_stdlib, compiler limits.
`xcrun metal` stays the authority.
"""

import os
import re
import shutil
from dataclasses import dataclass, field
from typing import List

HERE = os.path.dirname(os.path.abspath(__file__))
STUB_DIR = os.path.join(HERE, "strict")

_KERNEL_ATTRS = re.compile(r"template \[\[host_name\(name\)\]\] \[\[kernel\]\]")
_TG_ARRAY = re.compile(r"^(\s+)threadgroup (\w+) (\w+)\[(.*)\];", re.MULTILINE)


def prepare(src: str, dst: str) -> str:
    """Copies the Metal sources in ``src`` to ``dst`` with the check-only rewrites."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        path = os.path.join(dst, name)
        with open(path) as f:
            text = f.read()
        text = _KERNEL_ATTRS.sub("template", text)
        text = _TG_ARRAY.sub(r"\1threadgroup \2* \3 = mlxq_check_tg<\2, (\4)>();", text)
        with open(path, "w") as f:
            f.write(text)
    return dst


@dataclass
class Result:
    path: str
    errors: List[str] = field(default_factory=list)
    generic_pointers: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.errors or self.generic_pointers)


def check(prepared: str, path: str) -> Result:
    """Parses one prepared .metal file; its compile errors and generic pointers."""
    import clang.cindex as ci

    tu = ci.Index.create().parse(
        path,
        args=[
            "--target=spir64",
            "-x",
            "clcpp",
            "-cl-std=clc++2021",
            "-cl-no-stdinc",
            "-fno-builtin",
            "-Wno-unknown-attributes",
            "-Wno-ignored-attributes",
            "-isystem",
            STUB_DIR,
            "-I",
            prepared,
        ],
    )
    result = Result(path)
    result.errors = [str(d) for d in tu.diagnostics if d.severity >= ci.Diagnostic.Error]
    decls = (ci.CursorKind.PARM_DECL, ci.CursorKind.VAR_DECL, ci.CursorKind.FIELD_DECL)
    seen = set()
    for c in tu.cursor.walk_preorder():
        if c.kind not in decls or not c.location.file:
            continue
        where = c.location.file.name
        if where.startswith(STUB_DIR):
            continue
        t = c.type.spelling
        if "__generic" in t and "*" in t:
            seen.add(f"{where}:{c.location.line} {c.spelling}: {t}")
    result.generic_pointers = sorted(seen)
    return result


def apply_diff(directory: str, diff_path: str) -> str:
    """Applies a unified diff's hunks to files in ``directory`` by text
    (context and removed lines must appear exactly once); returns the file."""
    with open(diff_path) as f:
        lines = f.read().splitlines()
    target = next(line[len("+++ b/") :] for line in lines if line.startswith("+++ b/"))
    path = os.path.join(directory, target)
    with open(path) as f:
        text = f.read()
    hunks, old, new = [], None, None
    for line in lines:
        if line.startswith("@@"):
            if old is not None:
                hunks.append((old, new))
            old, new = [], []
        elif old is not None and not line.startswith(("---", "+++")):
            tag, body = line[:1], line[1:]
            if tag in (" ", "-"):
                old.append(body)
            if tag in (" ", "+"):
                new.append(body)
    if old is not None:
        hunks.append((old, new))
    for old, new in hunks:
        before, after = "\n".join(old) + "\n", "\n".join(new) + "\n"
        if text.count(before) != 1:
            raise ValueError(f"{diff_path}: hunk does not match {target} exactly once")
        text = text.replace(before, after)
    with open(path, "w") as f:
        f.write(text)
    return path
