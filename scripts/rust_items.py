#!/usr/bin/env python3
"""The items of Rust source files, read by a small brace scanner (no compiler, no dependency).

It skips comments, strings (raw ones too), char literals and lifetimes, and records:
- every `fn` item (any of `pub(..)`, `const`, `async`, `unsafe`, `extern "C"` before it), from
  the line of its `fn` to the line of the `}` that closes the brace its body opened; a `;` at
  the signature's own depth before any `{` makes it a declaration (a trait's required method,
  an `extern` block's function): no body, no length;
- the `impl [Trait for] Type` and `trait Name` blocks around them;
- the types the files define (struct, enum, union, trait);
- every string literal, with its line;
- which of all this is test code: under `#[test]` or a `cfg` that holds only under test
  (`#[cfg(test)]`, `#[cfg(all(test, ..))]`), inside such a module, in a file such a module
  declares (`#[cfg(test)] mod tests;`), or in a file named `tests.rs`.

Used by scripts/longest-fns.sh (the longest functions), scripts/gradient_way.py (which item
holds an executed line) and scripts/house-figures.sh (string literals of non-test code).

As a program: `rust_items.py fns [--tests] [--decls] PATH...` prints one function a line,
`LINES FILE:LINE NAME` (LINES 0 for a declaration), for the `.rs` files under each PATH
(directories named tests, examples, benches and target are left out, and files named tests.rs;
a file named on the command line is always read). `rust_items.py strings PATH...` prints the
string literals of non-test code, `FILE:LINE<TAB>TEXT` (TEXT as written, escapes kept).
"""

import os
import re
import sys
from dataclasses import dataclass, field
from typing import List, Optional

SKIPPED_DIRS = {"tests", "examples", "benches", "target"}


@dataclass
class Tok:
    kind: str  # ident, punct, str, char, life, num
    text: str
    line: int


@dataclass
class Impl:
    trait: Optional[str]  # None: an inherent impl
    self_type: Optional[str]
    start: int
    end: int = 0
    test: bool = False
    header: str = ""  # the tokens from `impl` to its `{`, space-joined


@dataclass
class TraitDef:
    name: str
    start: int
    end: int = 0
    test: bool = False


@dataclass
class Fn:
    name: str
    start: int
    end: int = 0  # 0 until its body closes; stays 0 for a declaration
    decl: bool = False
    test: bool = False
    impl: Optional[Impl] = None
    trait_def: Optional[TraitDef] = None
    signature: str = ""  # the tokens from `fn` to the body's `{` (or the `;`), space-joined
    public: bool = False  # `pub` or `pub(..)`

    @property
    def lines(self) -> int:
        return 0 if self.decl or not self.end else self.end - self.start + 1

    @property
    def qualified(self) -> str:
        owner = (self.impl.self_type if self.impl else None) or (self.trait_def.name if self.trait_def else None)
        return f"{owner}::{self.name}" if owner else self.name


@dataclass
class FileItems:
    path: str
    fns: List[Fn] = field(default_factory=list)
    impls: List[Impl] = field(default_factory=list)
    traits: List[TraitDef] = field(default_factory=list)
    types: List[str] = field(default_factory=list)
    strings: List[tuple] = field(default_factory=list)  # (line, text, test, attribute)
    test_mods: List[str] = field(default_factory=list)  # files that `#[cfg(test)] mod x;` declares
    test_file: bool = False

    def fn_at(self, line: int) -> Optional[Fn]:
        """The innermost function whose body holds `line`."""
        best = None
        for f in self.fns:
            if not f.decl and f.end and f.start <= line <= f.end:
                if best is None or f.start >= best.start:
                    best = f
        return best


# --- the lexer ------------------------------------------------------------------------------

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUM = re.compile(r"[0-9][0-9A-Za-z_]*")


def _string_end(src: str, i: int) -> int:
    """`src[i]` is the opening quote of a plain string: the index just past its closing one."""
    i += 1
    while i < len(src):
        c = src[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return i


def tokens(src: str) -> List[Tok]:
    out = []
    i, line, n = 0, 1, len(src)
    while i < n:
        c = src[i]
        if c == "\n":
            line += 1
            i += 1
            continue
        if c.isspace():
            i += 1
            continue
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
            continue
        if src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            line += src.count("\n", i, j)
            i = j
            continue
        # raw strings (r"..", r#".."#, br#".."#, cr".."), before identifiers
        m = re.match(r'(?:b|c)?r(#*)"', src[i:i + 260])
        if m:
            close = '"' + m.group(1)
            j = src.find(close, i + m.end())
            j = n if j < 0 else j + len(close)
            out.append(Tok("str", src[i:j], line))
            line += src.count("\n", i, j)
            i = j
            continue
        if c == '"' or (c in "bc" and src.startswith('"', i + 1)):
            start = i
            j = _string_end(src, i if c == '"' else i + 1)
            out.append(Tok("str", src[start:j], line))
            line += src.count("\n", start, j)
            i = j
            continue
        if c == "b" and src.startswith("'", i + 1):
            i += 1
            c = "'"  # a byte literal: read as a char literal below
        if c == "'":
            if src.startswith("\\", i + 1):
                j = src.find("'", i + 3)
                j = n if j < 0 else j + 1
                out.append(Tok("char", src[i:j], line))
                i = j
                continue
            if i + 2 < n and src[i + 2] == "'":
                out.append(Tok("char", src[i:i + 3], line))
                i += 3
                continue
            m = _IDENT.match(src, i + 1)
            if m:
                out.append(Tok("life", src[i:m.end()], line))
                i = m.end()
                continue
            out.append(Tok("punct", c, line))
            i += 1
            continue
        if src.startswith("r#", i):
            m = _IDENT.match(src, i + 2)
            if m:
                out.append(Tok("ident", m.group(0), line))
                i = m.end()
                continue
        m = _IDENT.match(src, i + 1 if c == "$" else i)  # `$name`: a macro's variable
        if m:
            out.append(Tok("ident", src[i:m.end()], line))
            i = m.end()
            continue
        m = _NUM.match(src, i)
        if m:
            out.append(Tok("num", m.group(0), line))
            i = m.end()
            continue
        out.append(Tok("punct", c, line))
        i += 1
    return out


# --- cfg predicates -------------------------------------------------------------------------


def _cfg_value(toks: List[Tok], i: int):
    """Evaluates the cfg predicate at `toks[i]` with `test` false and every other option
    unknown: (True/False/None, index past it)."""
    t = toks[i]
    if t.kind != "ident":
        return None, i + 1
    name = t.text
    if i + 1 < len(toks) and toks[i + 1].text == "(":
        args, j = [], i + 2
        while j < len(toks) and toks[j].text != ")":
            if toks[j].text == ",":
                j += 1
                continue
            v, j = _cfg_value(toks, j)
            args.append(v)
        j += 1
        if name in ("all", "cfg"):
            return (False if False in args else True if all(a is True for a in args) else None), j
        if name == "any":
            return (True if True in args else False if all(a is False for a in args) else None), j
        if name == "not":
            a = args[0] if args else None
            return (None if a is None else not a), j
        return None, j
    j = i + 1
    if j < len(toks) and toks[j].text == "=":
        return None, j + 2  # feature = "x", target_os = "y": not known here
    return (False if name == "test" else None), j


def _attribute_is_test(attr: List[Tok]) -> bool:
    """`attr` is the inside of `#[...]`: true for `test`, `x::test`, and a `cfg(..)` that can
    hold only under test."""
    texts = [t.text for t in attr]
    if texts == ["test"] or (len(texts) > 3 and texts[-3:] == [":", ":", "test"]
                             and all(t == ":" or t.isidentifier() for t in texts)):
        return True
    if texts[:2] == ["cfg", "("]:
        v, _ = _cfg_value(attr, 0)
        return v is False
    return False


# --- the scanner ----------------------------------------------------------------------------

_ITEM_START = {None, ";", "}", "{", "]"}
_FN_MODIFIERS = {"pub", "const", "async", "unsafe", "extern", "default", ")", "crate", "(", "in", "self", "super"}


def _last_ident(toks: List[Tok], skip=("dyn", "mut", "const", "crate", "self", "super")) -> Optional[str]:
    """The last identifier outside angle brackets and parentheses: `a::b::Foo<T>` -> Foo."""
    depth, name = 0, None
    for k, t in enumerate(toks):
        if t.text in "<([":
            depth += 1
        elif t.text in ">)]" and not (t.text == ">" and k and toks[k - 1].text in "-="):
            depth -= 1
        elif depth == 0 and t.kind == "ident" and t.text not in skip:
            name = t.text
    return name


def _parse_impl(header: List[Tok]):
    """`impl<..> Trait for Type where ..` -> (trait or None, type)."""
    k = 1
    if k < len(header) and header[k].text == "<":
        depth = 0
        while k < len(header):
            t = header[k].text
            if t == "<":
                depth += 1
            elif t == ">" and header[k - 1].text not in "-=":
                depth -= 1
                if depth == 0:
                    k += 1
                    break
            k += 1
    body = header[k:]
    depth, split, end = 0, None, len(body)
    for j, t in enumerate(body):
        if t.text in "<([":
            depth += 1
        elif t.text in ">)]" and not (t.text == ">" and j and body[j - 1].text in "-="):
            depth -= 1
        elif depth == 0 and t.text == "where":
            end = j
            break
        elif depth == 0 and t.text == "for" and split is None and not (j + 1 < len(body) and body[j + 1].text == "<"):
            split = j
    if split is None:
        return None, _last_ident(body[:end])
    return _last_ident(body[:split]), _last_ident(body[split + 1:end])


def scan(path: str, src: Optional[str] = None) -> FileItems:
    if src is None:
        with open(path, encoding="utf-8", errors="replace") as f:
            src = f.read()
    toks = tokens(src)
    items = FileItems(path)
    items.test_file = os.path.basename(path) == "tests.rs"
    # frames: one per open bracket; a brace frame may carry an item
    frames = []  # dicts: {"open": "{", "test": bool, "fn": Fn?, "impl": Impl?, "trait": TraitDef?}
    pending = None  # the item whose header is being read: {"kind", "depth", "obj", "toks"}
    pending_test = False  # an attribute making the next item test code
    in_attr = 0  # depth of `#[` being read (strings there are attribute strings)
    attr_start = None
    prev = None  # the previous significant token's text

    def test_here() -> bool:
        return items.test_file or (frames[-1]["test"] if frames else False)

    def enclosing(key):
        for fr in reversed(frames):
            if fr.get(key) is not None:
                return fr[key]
            if key != "fn" and fr.get("fn") is not None:
                return None  # an impl inside a function body belongs to that body
        return None

    i = 0
    while i < len(toks):
        t = toks[i]
        x = t.text
        # attributes: #[..] and #![..]
        if x == "#" and i + 1 < len(toks) and toks[i + 1].text in ("[", "!"):
            inner = toks[i + 1].text == "!"
            j = i + (2 if inner else 1)
            if j < len(toks) and toks[j].text == "[":
                depth, k = 0, j
                while k < len(toks):
                    if toks[k].text == "[":
                        depth += 1
                    elif toks[k].text == "]":
                        depth -= 1
                        if depth == 0:
                            break
                    k += 1
                attr = toks[j + 1:k]
                is_test = _attribute_is_test(attr)
                is_doc = bool(attr) and attr[0].text == "doc"
                for a in attr:
                    if a.kind == "str" and not is_doc:
                        items.strings.append((a.line, a.text, test_here() or pending_test or is_test, True))
                if is_test:
                    if inner:
                        if frames:
                            frames[-1]["test"] = True
                        else:
                            items.test_file = True
                    else:
                        pending_test = True
                i = k + 1
                prev = "]"
                continue
        if t.kind == "str" and prev != "extern":  # not an ABI's name
            items.strings.append((t.line, x, test_here() or pending_test, False))
        if pending is not None:
            pending["toks"].append(t)
        depth_now = len(frames)
        if x in "([{":
            if x == "{" and pending is not None and depth_now == pending["depth"]:
                kind, obj = pending["kind"], pending["obj"]
                fr = {"open": "{", "test": test_here() or pending_test or pending["test"]}
                if kind == "fn":
                    obj.signature = " ".join(tt.text for tt in pending["toks"][:-1])
                    obj.test = fr["test"]
                    fr["fn"] = obj
                    items.fns.append(obj)
                elif kind == "impl":
                    obj.trait, obj.self_type = _parse_impl(pending["toks"][:-1])
                    obj.header = " ".join(tt.text for tt in pending["toks"][:-1])
                    obj.test = fr["test"]
                    fr["impl"] = obj
                    items.impls.append(obj)
                elif kind == "trait":
                    obj.test = fr["test"]
                    fr["trait"] = obj
                    items.traits.append(obj)
                frames.append(fr)
                pending = None
                pending_test = False
            else:
                fr = {"open": x, "test": test_here() or (pending_test if x == "{" else False)}
                if x == "{":
                    pending_test = False
                frames.append(fr)
            prev = x
            i += 1
            continue
        if x in ")]}":
            if frames:
                fr = frames.pop()
                if fr.get("fn") is not None:
                    fr["fn"].end = t.line
                if fr.get("impl") is not None:
                    fr["impl"].end = t.line
                if fr.get("trait") is not None:
                    fr["trait"].end = t.line
            prev = x
            i += 1
            continue
        if x == ";":
            if pending is not None and depth_now == pending["depth"]:
                if pending["kind"] == "fn":
                    obj = pending["obj"]
                    obj.decl = True
                    obj.end = t.line
                    obj.signature = " ".join(tt.text for tt in pending["toks"][:-1])
                    obj.test = test_here() or pending_test or pending["test"]
                    items.fns.append(obj)
                pending = None
            if depth_now == 0 or frames[-1]["open"] == "{":
                pending_test = False
            prev = x
            i += 1
            continue
        if t.kind == "ident" and pending is None:
            nxt = toks[i + 1] if i + 1 < len(toks) else None
            if x == "fn" and nxt is not None and nxt.kind == "ident":
                # `pub`, `pub(crate)`, `const`, `unsafe`, `extern "C"` may stand before it
                k, public = i - 1, False
                while k >= 0 and (toks[k].text in _FN_MODIFIERS or toks[k].kind == "str"):
                    if toks[k].text == "pub":
                        public = True
                    k -= 1
                obj = Fn(nxt.text, t.line, public=public,
                         impl=enclosing("impl"), trait_def=enclosing("trait"))
                pending = {"kind": "fn", "depth": depth_now, "obj": obj, "toks": [t], "test": pending_test}
            elif x == "impl" and (prev in _ITEM_START or (prev in ("unsafe", "default") and i >= 2
                                                           and (toks[i - 2].text in _ITEM_START))):
                pending = {"kind": "impl", "depth": depth_now, "obj": Impl(None, None, t.line), "toks": [t],
                           "test": pending_test}
            elif x == "trait" and nxt is not None and nxt.kind == "ident":
                items.types.append(nxt.text)
                pending = {"kind": "trait", "depth": depth_now, "obj": TraitDef(nxt.text, t.line), "toks": [t],
                           "test": pending_test}
            elif x in ("struct", "enum", "union") and nxt is not None and nxt.kind == "ident" \
                    and prev not in ("::", ":"):
                if x != "union" or (i + 2 < len(toks) and toks[i + 2].text in ("{", "<")):
                    items.types.append(nxt.text)
            elif x == "mod" and nxt is not None and nxt.kind == "ident" and i + 2 < len(toks) \
                    and toks[i + 2].text == ";" and (pending_test or test_here()):
                items.test_mods.append(_mod_file(path, nxt.text, toks, i))
        prev = x
        i += 1
    return items


def _mod_file(path: str, name: str, toks: List[Tok], i: int) -> str:
    """The file that `mod name;` at `toks[i]` in `path` declares (a `#[path = ".."]` before it
    wins)."""
    here = os.path.dirname(path)
    for k in range(i - 1, max(i - 12, -1), -1):
        if toks[k].text == "path" and k + 2 < len(toks) and toks[k + 1].text == "=" and toks[k + 2].kind == "str":
            return os.path.normpath(os.path.join(here, toks[k + 2].text.strip('"')))
    base = os.path.basename(path)
    if base not in ("mod.rs", "lib.rs", "main.rs"):
        here = os.path.join(here, os.path.splitext(base)[0])
    flat = os.path.join(here, name + ".rs")
    return os.path.normpath(flat if os.path.exists(flat) else os.path.join(here, name, "mod.rs"))


def rust_files(paths: List[str]) -> List[str]:
    """The `.rs` files under `paths`, test folders and files left out (a named file is kept)."""
    out = []
    for p in paths:
        if os.path.isfile(p):
            out.append(os.path.normpath(p))
            continue
        for root, dirs, files in os.walk(p):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("."))
            for f in sorted(files):
                if f.endswith(".rs") and f != "tests.rs":
                    out.append(os.path.normpath(os.path.join(root, f)))
    return out


def scan_all(paths: List[str]) -> List[FileItems]:
    """Every file under `paths`, scanned; files that a `#[cfg(test)] mod x;` declares are test
    files (and so are what they declare in turn, as they are read later)."""
    scanned = [scan(f) for f in rust_files(paths)]
    tests = set()
    for it in scanned:
        tests.update(it.test_mods)
    changed = True
    while changed:
        changed = False
        for it in scanned:
            if it.path in tests and not it.test_file:
                it.test_file = True
                for f in it.fns:
                    f.test = True
                for s in range(len(it.strings)):
                    it.strings[s] = it.strings[s][:2] + (True,) + it.strings[s][3:]
                tests.update(it.test_mods)
                changed = True
    return scanned


def main(argv: List[str]) -> int:
    if not argv or argv[0] not in ("fns", "strings"):
        print(__doc__.strip().split("\n\n")[-1], file=sys.stderr)
        return 2
    what, args = argv[0], argv[1:]
    want_tests = "--tests" in args
    want_decls = "--decls" in args
    paths = [a for a in args if not a.startswith("--")] or ["crates"]
    for p in paths:
        if not os.path.exists(p):
            print(f"rust_items.py: no such file or directory: {p}", file=sys.stderr)
            return 1
    for it in scan_all(paths):
        if it.test_file and not want_tests:
            continue
        if what == "fns":
            for f in it.fns:
                if (f.test and not want_tests) or (f.decl and not want_decls):
                    continue
                print(f"{f.lines} {it.path}:{f.start} {f.qualified}")
        else:
            for line, text, test, _ in it.strings:
                if not test:
                    print(f"{it.path}:{line}\t{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
