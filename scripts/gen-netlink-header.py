#!/usr/bin/env python3
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
"""Write the C UAPI header of a generic-netlink family from its YNL spec.

usage: gen-netlink-header.py SPEC [-o HEADER]

`make netlink-header` runs it on Documentation/netlink/specs/gpupin.yaml and
writes include/uapi/gpupin_netlink.h; scripts/ci/check-netlink.sh runs it into
a temporary file and fails while the committed header differs.  The layout is
that of the kernel's tools/net/ynl/ynl-gen-c.py for uapi headers (family
defines, enums, attribute sets, commands, multicast-group defines), with each
enum's documentation as a kernel-doc comment above it.

It knows the genetlink-c subset this family uses, and stops naming what it
does not know when a spec asks for more: enum and const definitions (not
flags or structs), attribute sets without subset-of and attributes without a
name-prefix of their own, the unified operations model (no async-prefix), and
multicast groups.  Names and numbers follow YNL and ynl-gen-c: NAME-PREFIX +
name, upper-cased, dashes to underscores (the defaults are ynl-gen-c's);
attributes and operations count from 1, enum entries from value-start (0),
each `value:` restarting the count.  With max-by-define the MAX names are
#defines after the enum, else enumerators.  Unlike ynl-gen-c it takes any
licence (the spec's SPDX line is the header's), names the include guard
_UAPI_<UAPI-HEADER>_H (no LINUX_), and documents attribute sets and commands
too, each entry with its type or mode.  It validates nothing against the
kernel's schema (tests/vm/test_ynl.py does, through the kernel's YNL library).
"""

from __future__ import annotations

import argparse
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
ATTRIBUTE_SET_KEYS = set("name doc name-prefix enum-name attr-cnt-name attr-max-name attributes".split())
OPERATIONS_KEYS = set("enum-model name-prefix enum-name list".split())


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


class Header:
    """The header's lines, built from the parsed spec."""

    def __init__(self, spec: dict[str, Any], spdx: str, source: str) -> None:
        check_keys("the family", spec, FAMILY_KEYS)
        if spec.get("protocol", "genetlink") not in ("genetlink", "genetlink-c"):
            raise SpecError(f"protocol {spec['protocol']}: only genetlink and genetlink-c are supported")
        self.spec = spec
        self.family = spec["name"]
        self.max_by_define = bool(spec.get("max-by-define", False))
        self.sets = {s["name"]: s for s in spec["attribute-sets"]}
        self.enums = {d["name"]: d for d in spec.get("definitions", []) if d["type"] == "enum"}
        self.lines = [
            f"/* SPDX-License-Identifier: {spdx} */",
            "/*",
            f" * Do not edit: generated from {source}",
            f" * by {shown_path(Path(__file__))}; run `make netlink-header`.",
            " */",
            "",
        ]

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
            check_keys(f"attribute set {aset['name']}", aset, ATTRIBUTE_SET_KEYS)
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


def generate(spec_path: Path) -> str:
    text = spec_path.read_text()
    return Header(yaml.safe_load(text), spdx_of(text), shown_path(spec_path)).render()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path, help="the family's YNL spec (YAML)")
    ap.add_argument("-o", "--output", type=Path, help="the header to write (default: standard output)")
    args = ap.parse_args()
    try:
        out = generate(args.spec)
    except SpecError as exc:
        print(f"gen-netlink-header: {args.spec}: {exc}", file=sys.stderr)
        return 1
    except KeyError as exc:
        print(f"gen-netlink-header: {args.spec}: {exc} is missing or names nothing", file=sys.stderr)
        return 1
    if args.output:
        args.output.write_text(out)
    else:
        sys.stdout.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
