#!/usr/bin/env python3
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
"""Write the C UAPI header of a generic-netlink family, and its kernel policies and ops, from its YNL spec.

usage: gen-netlink-header.py SPEC [-o HEADER [--kernel-source C --kernel-header H]] [--into DIR]

`make netlink-header` runs it on Documentation/netlink/specs/gpupin.yaml and
writes include/uapi/gpupin_netlink.h, kernel/netlink-gen.c and
kernel/netlink-gen.h; scripts/ci/check-netlink.sh runs it into a temporary
directory (--into) and fails while any committed file differs.  The header's
layout is that of the kernel's tools/net/ynl/ynl-gen-c.py for uapi headers
(family defines, enums, attribute sets, commands, multicast-group defines),
with each enum's documentation as a kernel-doc comment above it.

The kernel pair is what ynl-gen-c writes for a family's kernel side (as
net/handshake/genl.c and genl.h), the handlers staying hand-written: one
request policy per command, <family>_<op>_nl_policy, from the attributes its
`request:` lists and their `checks:` (min, max); the ops array
<family>_nl_ops with the handlers <family>_nl_<op>_doit or _dumpit and
GENL_ADMIN_PERM for `flags: [admin-perm]`; the header declares both.  Unlike
ynl-gen-c it writes plain struct genl_ops (each command is a do or a dump,
never both, so one policy per command says all that split ops would, and
genl_ops exist on every kernel gpupin builds for), and a command that takes
no attributes gets a policy that rejects them all, shared between such
commands (the genl core's own for commands from resv_start_op on, written
out rather than relied upon).  Where YNL has no way to say it, a subset-of
attribute set may give an attribute other `checks:` (none: `checks: {}`) for
the commands using that set; the kernel's YNL tools read the parent set's.
The family struct and its multicast groups stay hand-written too.

It knows the genetlink-c subset this family uses, and stops naming what it
does not know when a spec asks for more: enum and const definitions (not
flags or structs), attribute sets without per-attribute name-prefix, subsets
restating only checks, the unified operations model (no async-prefix), and
multicast groups; in the kernel code integer and flag request attributes,
do or dump (not both), no dont-validate, config-cond, pre or post hooks.
Names and numbers follow YNL and ynl-gen-c: NAME-PREFIX + name, upper-cased,
dashes to underscores (the defaults are ynl-gen-c's); attributes and
operations count from 1, enum entries from value-start (0), each `value:`
restarting the count.  With max-by-define the MAX names are #defines after
the enum, else enumerators.  Unlike ynl-gen-c it takes any licence (the
spec's SPDX line is the header's; the kernel files take it without the
syscall note), names the include guard _UAPI_<UAPI-HEADER>_H (no LINUX_), and
documents attribute sets and commands too, each entry with its type or mode.
It validates nothing against the kernel's schema (tests/vm/test_ynl.py does,
through the kernel's YNL library).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 79  # the longest comment line written

# The properties understood, per part of the spec; any other stops the generator.
FAMILY_KEYS = set(
    "name doc protocol uapi-header c-family-name c-version-name max-by-define cmd-max-name cmd-cnt-name"
    " definitions attribute-sets operations mcast-groups kernel-family version".split()
)
DEFINITION_KEYS = set("name type doc entries value-start value name-prefix enum-name render-max header scope".split())
ATTRIBUTE_SET_KEYS = set("name doc name-prefix enum-name attr-cnt-name attr-max-name attributes subset-of".split())
OPERATIONS_KEYS = set("enum-model name-prefix enum-name list".split())
# What the kernel code understands of a command, of its do or dump, and of an attribute's checks.
OPERATION_KEYS = set("name doc value attribute-set flags do dump event mcgrp".split())
SUBOP_KEYS = {"request", "reply"}
CHECK_KEYS = {"min", "max"}
# The request attribute types, as policy types; a policy's min and max are s16 on every kernel.
NLA_TYPES = {
    **{t: f"NLA_{t.upper()}" for t in "u8 u16 u32 u64 s8 s16 s32 s64".split()},
    "flag": "NLA_FLAG",
}
S16 = range(-(1 << 15), 1 << 15)


class SpecError(Exception):
    pass


def c_upper(name: str) -> str:
    return name.upper().replace("-", "_")


def c_lower(name: str) -> str:
    return name.lower().replace("-", "_")


def shown_path(path: Path) -> str:
    """PATH as the banner names it: relative to the tree when inside it, else as given."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def spdx_of(text: str) -> str:
    m = re.match(r"#\s*SPDX-License-Identifier:\s*(.+)", text)
    if not m:
        raise SpecError("the spec's first line must be its '# SPDX-License-Identifier: ...'")
    return m.group(1).strip()


def comment(paragraphs: list[str], kdoc: bool = False) -> list[str]:
    """A block comment of PARAGRAPHS, each reflowed to WIDTH; '/**' (kernel-doc) with KDOC."""
    out = ["/**" if kdoc else "/*"]
    for i, para in enumerate(paragraphs):
        if i:
            out.append(" *")
        out += [" * " + line for line in textwrap.wrap(para, WIDTH - 3, break_on_hyphens=False)]
    return out + [" */"]


def member_doc(name: str, text: str) -> list[str]:
    """One kernel-doc '@NAME: TEXT' item, continuation lines indented."""
    lines = textwrap.wrap(
        f"@{name}: {text}", WIDTH - 3, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False
    )
    return [" * " + line for line in lines]


def paragraphs(doc: str | None) -> list[str]:
    """A YAML doc string as paragraphs: blank lines split, line breaks inside are spaces."""
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc or "") if p.strip()]


def defines(pairs: list[tuple[str, str]]) -> list[str]:
    """#define lines with their values aligned on a tab stop."""
    width = max(len(name) for name, _ in pairs) + len("#define ")
    col = (width // 8 + 1) * 8
    return [f"#define {name}" + "\t" * ((col - len("#define " + name) + 7) // 8) + value for name, value in pairs]


def numbered(items: list[dict[str, Any]], start: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(value, item) as YNL numbers them: an item's `value:`, else one more than the previous one."""
    value = start
    for item in items:
        value = item.get("value", value)
        yield value, item
        value += 1


def c_value(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


def check_keys(what: str, obj: dict[str, Any], known: set[str]) -> None:
    extra = sorted(set(obj) - known)
    if extra:
        raise SpecError(f"{what}: {', '.join(extra)} not supported by {Path(__file__).name}")


def banner(spdx: str, source: str, c_source: bool = False) -> list[str]:
    """The SPDX line (a C source's as a // comment) and the do-not-edit comment."""
    first = f"// SPDX-License-Identifier: {spdx}" if c_source else f"/* SPDX-License-Identifier: {spdx} */"
    return [
        first,
        "/*",
        f" * Do not edit: generated from {source}",
        f" * by {shown_path(Path(__file__))}; run `make netlink-header`.",
        " */",
    ]


def kernel_spdx(spdx: str) -> str:
    """The licence of the kernel files: the spec's without the syscall note, which is for UAPI headers."""
    out = re.sub(r"\((GPL-2\.0[-+a-z]*) WITH Linux-syscall-note\)", r"\1", spdx)
    return re.sub(r"(GPL-2\.0[-+a-z]*) WITH Linux-syscall-note", r"\1", out)


def include_path(target: Path, includer: Path) -> str:
    """How INCLUDER names TARGET in an #include "...": relative to INCLUDER's directory."""
    return os.path.relpath(target.resolve(), includer.resolve().parent)


class Family:
    """The parsed spec, and the C names ynl-gen-c forms from it."""

    def __init__(self, spec: dict[str, Any]) -> None:
        check_keys("the family", spec, FAMILY_KEYS)
        if spec.get("protocol", "genetlink") not in ("genetlink", "genetlink-c"):
            raise SpecError(f"protocol {spec['protocol']}: only genetlink and genetlink-c are supported")
        self.spec = spec
        self.family = spec["name"]
        self.sets = {s["name"]: s for s in spec["attribute-sets"]}
        for aset in spec["attribute-sets"]:
            check_keys(f"attribute set {aset['name']}", aset, ATTRIBUTE_SET_KEYS)
            parent = self.sets.get(aset.get("subset-of", aset["name"]))
            if parent is None or "subset-of" in parent:
                raise SpecError(f"attribute set {aset['name']}: subset-of names no full attribute set")
            if parent is not aset:
                known = {a["name"] for a in parent["attributes"]}
                for entry in aset["attributes"]:
                    check_keys(f"attribute set {aset['name']}, {entry['name']}", entry, {"name", "checks"})
                    if entry["name"] not in known:
                        raise SpecError(f"attribute set {aset['name']}: {parent['name']} has no {entry['name']}")
        self.enums = {d["name"]: d for d in spec.get("definitions", []) if d["type"] == "enum"}

    # Names, as ynl-gen-c forms them.

    def set_prefix(self, aset: dict[str, Any]) -> str:
        if "name-prefix" in aset:
            return c_upper(aset["name-prefix"])
        if aset["name"] == self.family:
            return c_upper(f"{self.family}-a-")
        return c_upper(f"{self.family}-a-{aset['name']}-")

    def enum_prefix(self, enum: dict[str, Any]) -> str:
        return c_upper(enum.get("name-prefix", f"{self.family}-{enum['name']}-"))

    def enum_tag(self, obj: dict[str, Any], default: str | None) -> str | None:
        """The C enum's tag: enum-name (null: none), else DEFAULT."""
        if "enum-name" in obj:
            return c_lower(obj["enum-name"]) if obj["enum-name"] else None
        return default

    def attr_values(self, aset: dict[str, Any]) -> dict[str, tuple[int, dict[str, Any]]]:
        """The attributes of ASET by name, each with its value (a subset's from its parent)."""
        full = self.sets[aset.get("subset-of", aset["name"])]
        values = {a["name"]: (value, a) for value, a in numbered(full["attributes"], 1)}
        return {e["name"]: values[e["name"]] for e in aset["attributes"]}

    def attr_name(self, aset: dict[str, Any], attr: str) -> str:
        """The C enumerator of ASET's attribute ATTR (a subset's is its parent's)."""
        return self.set_prefix(self.sets[aset.get("subset-of", aset["name"])]) + c_upper(attr)


class Header(Family):
    """The UAPI header's lines, built from the parsed spec."""

    def __init__(self, spec: dict[str, Any], spdx: str, source: str) -> None:
        super().__init__(spec)
        self.max_by_define = bool(spec.get("max-by-define", False))
        self.lines = banner(spdx, source) + [""]

    # Blocks.

    def emit_enum(
        self,
        tag: str | None,
        summary: str,
        entries: list[tuple[str, int, str]],
        tail: tuple[str, str] | None = None,
        max_by_define: bool = False,
    ) -> None:
        """enum TAG { ENTRIES (C name, value, doc) }, kernel-doc above.  TAIL: the (count, max)
        names, max an enumerator or (MAX_BY_DEFINE) a #define after the enum."""
        docs = [(name, doc) for name, _, doc in entries if doc]
        if summary or docs:
            head = f"enum {tag}" if tag else "enum"
            self.lines += comment([f"{head} - {summary}" if summary else head], kdoc=True)[:-1]
            for name, doc in docs:
                self.lines += member_doc(name, doc)
            self.lines.append(" */")
        self.lines.append(f"enum {tag} {{" if tag else "enum {")
        nxt = 0
        for name, value, _ in entries:
            self.lines.append(f"\t{name}," if value == nxt else f"\t{name} = {value},")
            nxt = value + 1
        if tail:
            cnt, mx = tail
            self.lines += ["", f"\t{cnt}" + ("" if max_by_define else ",")]
            if not max_by_define:
                self.lines.append(f"\t{mx} = ({cnt} - 1)")
        self.lines.append("};")
        if tail and max_by_define:
            self.lines += ["", f"#define {tail[1]} ({tail[0]} - 1)"]
        self.lines.append("")

    def emit_definitions(self) -> None:
        consts: list[tuple[str, str]] = []
        for d in self.spec.get("definitions", []):
            check_keys(f"definition {d['name']}", d, DEFINITION_KEYS)
            if d.get("header") or d.get("scope", "uapi") != "uapi":
                continue
            if d["type"] == "const":
                consts.append((c_upper(d.get("name-prefix", f"{self.family}-") + d["name"]), c_value(d["value"])))
                continue
            if d["type"] != "enum":
                raise SpecError(f"definition {d['name']}: type {d['type']} not supported (enum and const are)")
            prefix = self.enum_prefix(d)
            items = [e if isinstance(e, dict) else {"name": e} for e in d["entries"]]
            entries = [
                (prefix + c_upper(e["name"]), value, " ".join(paragraphs(e.get("doc"))))
                for value, e in numbered(items, d.get("value-start", 0))
            ]
            tail = (f"__{prefix}MAX", f"{prefix}MAX") if d.get("render-max") else None
            tag = self.enum_tag(d, c_lower(f"{self.family}-{d['name']}"))
            self.emit_enum(tag, " ".join(paragraphs(d.get("doc"))), entries, tail)
        if consts:
            self.lines += defines(consts) + [""]

    def attr_type(self, attr: dict[str, Any]) -> str:
        """What the attribute carries, for its doc: type, nest or enum, repetition."""
        kind = attr["type"]
        if kind == "nest":
            kind = f"nest of {self.set_prefix(self.sets[attr['nested-attributes']])}*"
        elif "enum" in attr:
            kind += f", enum {self.enum_tag(self.enums[attr['enum']], c_lower(self.family + '-' + attr['enum']))}"
        if attr.get("multi-attr"):
            kind += ", repeated"
        return f"({kind})"

    def emit_attribute_sets(self) -> None:
        for aset in self.spec["attribute-sets"]:
            if "subset-of" in aset:  # its attributes are its parent's
                continue
            prefix = self.set_prefix(aset)
            entries = []
            for value, attr in numbered(aset["attributes"], 1):
                if "name-prefix" in attr:
                    raise SpecError(f"attribute {attr['name']}: name-prefix not supported")
                doc = "" if attr["type"] == "unused" else " ".join([self.attr_type(attr)] + paragraphs(attr.get("doc")))
                entries.append((prefix + c_upper(attr["name"]), value, doc))
            cnt = c_upper(aset.get("attr-cnt-name", f"__{prefix}MAX"))
            mx = c_upper(aset.get("attr-max-name", f"{prefix}MAX"))
            summary = " ".join(paragraphs(aset.get("doc"))) or f"Attribute set {aset['name']}."
            self.emit_enum(self.enum_tag(aset, None), summary, entries, (cnt, mx), self.max_by_define)

    def emit_operations(self) -> None:
        ops = self.spec["operations"]
        check_keys("operations", ops, OPERATIONS_KEYS)
        if ops.get("enum-model", "unified") != "unified":
            raise SpecError("operations: only enum-model unified is supported")
        prefix = c_upper(ops.get("name-prefix", f"{self.family}-cmd-"))
        entries = []
        for value, op in numbered(ops["list"], 1):
            modes = [m for m in ("do", "dump", "event") if m in op] + list(op.get("flags", []))
            if "mcgrp" in op:
                modes.append(f'group "{op["mcgrp"]}"')
            doc = " ".join(([f"({', '.join(modes)})"] if modes else []) + paragraphs(op.get("doc")))
            entries.append((prefix + c_upper(op["name"]), value, doc))
        cnt = c_upper(self.spec.get("cmd-cnt-name", f"__{prefix}MAX"))
        mx = c_upper(self.spec.get("cmd-max-name", f"{prefix}MAX"))
        self.emit_enum(self.enum_tag(ops, None), "The commands and events.", entries, (cnt, mx), self.max_by_define)

    def emit_mcast_groups(self) -> None:
        pairs = []
        for group in self.spec.get("mcast-groups", {}).get("list", []):
            name = group.get("c-define-name", f"{self.family}-mcgrp-{group['name']}")
            pairs.append((c_upper(name), c_value(group["name"])))
        if pairs:
            self.lines += defines(pairs) + [""]

    def render(self) -> str:
        guard = "_UAPI_" + c_upper(Path(self.spec.get("uapi-header", f"{self.family}.h")).stem) + "_H"
        self.lines += comment(paragraphs(self.spec.get("doc")))
        self.lines += [f"#ifndef {guard}", f"#define {guard}", ""]
        fam = c_upper(self.spec.get("c-family-name", f"{self.family}-family-name"))
        ver = c_upper(self.spec.get("c-version-name", f"{self.family}-family-version"))
        self.lines += defines([(fam, c_value(self.family)), (ver, str(self.spec.get("version", 1)))]) + [""]
        self.emit_definitions()
        self.emit_attribute_sets()
        self.emit_operations()
        self.emit_mcast_groups()
        self.lines.append(f"#endif /* {guard} */")
        return "\n".join(self.lines) + "\n"


class Kernel(Family):
    """The kernel's request policies and ops (a .c) and the header declaring them and the handlers."""

    def __init__(self, spec: dict[str, Any], spdx: str, source: str) -> None:
        super().__init__(spec)
        self.spdx = kernel_spdx(spdx)
        self.source = source
        self.ident = c_lower(self.family)
        prefix = c_upper(spec["operations"].get("name-prefix", f"{self.family}-cmd-"))
        # (command, mode, handler, policy, maxattr, flags) per command taking requests, in order
        self.ops: list[tuple[str, str, str, str, str, list[str]]] = []
        self.policies: dict[str, tuple[str, list[tuple[str, str]]]] = {}  # name: (comment, rows)
        for op in spec["operations"]["list"]:
            if "do" in op or "dump" in op:
                self.add_op(op, prefix + c_upper(op["name"]))

    def add_op(self, op: dict[str, Any], cmd: str) -> None:
        what = f"operation {op['name']}"
        check_keys(what, op, OPERATION_KEYS)
        if "do" in op and "dump" in op:
            raise SpecError(f"{what}: both do and dump not supported (one genl_ops policy serves both)")
        mode = "do" if "do" in op else "dump"
        sub = op[mode] or {}
        check_keys(f"{what} {mode}", sub, SUBOP_KEYS)
        check_keys(f"{what} {mode} request", sub.get("request") or {}, {"attributes"})
        flags = []
        for flag in op.get("flags", []):
            if flag != "admin-perm":
                raise SpecError(f"{what}: flag {flag} not supported (admin-perm is)")
            flags.append("GENL_ADMIN_PERM")
        aset = self.sets[op["attribute-set"]]
        names = (sub.get("request") or {}).get("attributes") or []
        if names:
            policy = f"{self.ident}_{c_lower(op['name'])}_nl_policy"
            rows = self.policy_rows(what, aset, names)
            self.policies[policy] = (f"{cmd} - {mode}", rows)
        else:
            policy, rows = self.no_attrs_policy(aset)
        handler = f"{self.ident}_nl_{c_lower(op['name'])}_{mode}it"
        self.ops.append((cmd, mode, handler, policy, rows[-1][0], flags))

    def policy_rows(self, what: str, aset: dict[str, Any], names: list[str]) -> list[tuple[str, str]]:
        """(attribute, policy) of each attribute NAMES lists, by value; a subset's checks replace its parent's."""
        values = self.attr_values(aset)
        own = {e["name"]: e for e in aset["attributes"]} if "subset-of" in aset else {}
        for name in names:
            if name not in values:
                raise SpecError(f"{what}: attribute set {aset['name']} has no {name}")
        rows = []
        for name in sorted(set(names), key=lambda n: values[n][0]):
            attr = values[name][1]
            checks = own[name]["checks"] if "checks" in own.get(name, {}) else attr.get("checks")
            rows.append((self.attr_name(aset, name), self.policy_of(f"{what}, {name}", attr, checks or {})))
        return rows

    @staticmethod
    def policy_of(what: str, attr: dict[str, Any], checks: dict[str, Any]) -> str:
        """One attribute's policy: its type, and its checks as the policy's own min and max."""
        nla = NLA_TYPES.get(attr["type"])
        if nla is None:
            raise SpecError(f"{what}: type {attr['type']} not supported in a request (integers and flag are)")
        check_keys(f"{what} checks", checks, CHECK_KEYS)
        lo, hi = checks.get("min"), checks.get("max")
        for limit in (lo, hi):
            if limit is None:
                continue
            if attr["type"] == "flag" or type(limit) is not int or limit not in S16:
                raise SpecError(f"{what}: checks are integer limits within s16 of an integer attribute")
            if attr["type"].startswith("u") and limit < 0:
                raise SpecError(f"{what}: a negative limit of an unsigned attribute")
        if lo is not None and hi is not None:
            return f"NLA_POLICY_RANGE({nla}, {lo}, {hi})"
        if lo is not None:
            return f"NLA_POLICY_MIN({nla}, {lo})"
        if hi is not None:
            return f"NLA_POLICY_MAX({nla}, {hi})"
        return f"{{ .type = {nla} }}"

    def no_attrs_policy(self, aset: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
        """The policy of commands that take no attributes from ASET's family of attributes: its
        first attribute rejected, the others unknown (strict validation).  One, shared."""
        full = self.sets[aset.get("subset-of", aset["name"])]
        name = f"{self.ident}_no_attrs_nl_policy"
        if full["name"] != self.family:
            name = f"{self.ident}_{c_lower(full['name'])}_no_attrs_nl_policy"
        first = [a for value, a in numbered(full["attributes"], 1) if value == 1]
        if not first:
            raise SpecError(f"attribute set {full['name']}: no attribute 1 for a policy rejecting all")
        rows = [(self.attr_name(full, first[0]["name"]), "{ .type = NLA_REJECT }")]
        self.policies.setdefault(name, ("Commands that take no attributes: any attribute is rejected.", rows))
        return name, rows

    def guard(self, header: Path) -> str:
        stem = c_upper(header.stem)
        return (stem if stem.startswith(c_upper(self.family) + "_") else c_upper(self.family) + "_" + stem) + "_H"

    def render_header(self, header: Path, uapi: Path) -> str:
        guard = self.guard(header)
        lines = banner(self.spdx, self.source) + [""]
        lines += comment(
            [
                f'The generic-netlink family "{self.family}" in the kernel: the ops array (its '
                "policies are in the generated source) and the handlers it names, which are written "
                "by hand."
            ]
        )
        lines += [f"#ifndef {guard}", f"#define {guard}", ""]
        lines += ["#include <net/genetlink.h>", f'#include "{include_path(uapi, header)}"', ""]
        for _, mode, handler, _, _, _ in self.ops:
            args = "struct genl_info *info" if mode == "do" else "struct netlink_callback *cb"
            lines.append(f"int {handler}(struct sk_buff *skb, {args});")
        lines += ["", f"extern const struct genl_ops {self.ident}_nl_ops[{len(self.ops)}];", ""]
        lines.append(f"#endif /* {guard} */")
        return "\n".join(lines) + "\n"

    def render_source(self, source: Path, header: Path) -> str:
        lines = banner(self.spdx, self.source, c_source=True) + [""]
        lines += comment(
            [
                f'The request policies and the ops of the generic-netlink family "{self.family}": '
                "what each command accepts (validated strictly: unknown attributes are errors) and "
                "who may send it.  The handlers and the family are written by hand."
            ]
        )
        lines += ["#include <net/genetlink.h>", "#include <net/netlink.h>", ""]
        lines += [f'#include "{include_path(header, source)}"', ""]
        for name, (what, rows) in self.policies.items():
            lines += [f"/* {what} */", f"static const struct nla_policy {name}[{rows[-1][0]} + 1] = {{"]
            lines += [f"\t[{attr}] = {policy}," for attr, policy in rows]
            lines += ["};", ""]
        lines += comment(
            [
                "One op per command that takes requests, in command order.  Each is a do or a "
                "dump, never both, so plain genl_ops with a policy each validate exactly what split "
                "ops would, and exist on older kernels too."
            ]
        )
        lines.append(f"const struct genl_ops {self.ident}_nl_ops[{len(self.ops)}] = {{")
        for cmd, mode, handler, policy, maxattr, flags in self.ops:
            lines += ["\t{", f"\t\t.cmd = {cmd},", f"\t\t.{mode}it = {handler},"]
            if flags:
                lines.append(f"\t\t.flags = {' | '.join(flags)},")
            lines += [f"\t\t.policy = {policy},", f"\t\t.maxattr = {maxattr},", "\t},"]
        lines.append("};")
        return "\n".join(lines) + "\n"


def generate(spec_path: Path) -> str:
    text = spec_path.read_text()
    return Header(yaml.safe_load(text), spdx_of(text), shown_path(spec_path)).render()


def generate_kernel(spec_path: Path, uapi: Path, source: Path, header: Path) -> tuple[str, str]:
    """The kernel source and header; their #include lines name HEADER and UAPI from where they are."""
    text = spec_path.read_text()
    kernel = Kernel(yaml.safe_load(text), spdx_of(text), shown_path(spec_path))
    return kernel.render_source(source, header), kernel.render_header(header, uapi)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path, help="the family's YNL spec (YAML)")
    ap.add_argument("-o", "--output", type=Path, help="the UAPI header to write (default: standard output)")
    ap.add_argument("--kernel-source", type=Path, help="the kernel policies and ops to write (a .c; needs -o)")
    ap.add_argument("--kernel-header", type=Path, help="the kernel header declaring them to write (a .h)")
    ap.add_argument(
        "--into",
        type=Path,
        metavar="DIR",
        help="write each file under DIR at its absolute path instead (the #include lines stay those of its path)",
    )
    args = ap.parse_args()
    if (args.kernel_source is None) != (args.kernel_header is None):
        ap.error("--kernel-source and --kernel-header go together")
    if (args.kernel_source or args.into) and not args.output:
        ap.error("--kernel-source and --into need -o (the kernel header includes the UAPI header)")
    try:
        outputs = {args.output: generate(args.spec)}
        if args.kernel_source:
            outputs[args.kernel_source], outputs[args.kernel_header] = generate_kernel(
                args.spec, args.output, args.kernel_source, args.kernel_header
            )
    except SpecError as exc:
        print(f"gen-netlink-header: {args.spec}: {exc}", file=sys.stderr)
        return 1
    except KeyError as exc:
        print(f"gen-netlink-header: {args.spec}: {exc} is missing or names nothing", file=sys.stderr)
        return 1
    for path, text in outputs.items():
        if path is None:
            sys.stdout.write(text)
            continue
        if args.into:
            path = args.into / path.resolve().relative_to(path.resolve().anchor)
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
