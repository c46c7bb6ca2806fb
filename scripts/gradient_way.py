#!/usr/bin/env python3
"""One gradient's way, counted, from a callgrind dump of the policies test `gradient_way` (see
scripts/gradient-way.sh, which makes the dump). Four figures:

files      the source files under crates/*/src with code that ran (inlined code included;
           code at line 0, which the compiler placed at no source line, belongs to none);
dispatch   the dispatch layers: the distinct traits whose implementations ran, counting a
           trait that chooses an implementation between the reducer and the transport (see
           "What is counted" below);
forms      the changes of form of the bucket's bytes: the distinct conversions between the
           bucket's representations that ran;
reentries  the files entered again outside an event: on one thread's call chain, a file that
           is entered, left for another file and entered again (A -> B -> A), other than
           through a call that is an event (the gradient-ready bus announcing, a work's
           completion running its continuations): those are listed apart, not counted.

Every executed line is mapped to the Rust item that holds it (the function, and the
`impl Trait for Type` or `trait` around it) by scripts/rust_items.py, which reads the sources
as they are, so renames and moves need no change here.

Usage: gradient_way.py DUMP [--check LIMITS] [--functions]
"""

import bisect
import os
import re
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ratchet  # noqa: E402
import rust_items  # noqa: E402

# --- What is counted: the one place to change it ------------------------------------------
#
# A dispatch layer is a trait call that chooses an implementation between the reducer and the
# transport. A trait counts when it is
#   - defined in the non-test code of one of these crates (the ones between the reducer and
#     the wire; autograd's bus and the optimizer are not on that part of the way),
BETWEEN_CRATES = ("comm", "ddp", "policies")
#   - implemented (non-test code of crates/*/src) for two or more types that the workspace
#     defines (so it can choose; a trait implemented for f32, f16 and bf16 is arithmetic),
MIN_IMPLEMENTATIONS = 2
#   - and is not the trait of a wrapper that only adds to the layer it wraps (the meter, the
#     tracer, the simulated link, the test recorder: the issue does not count them).
WRAPPER_TRAITS = ("Layer",)
# A trait counts once however many of its implementations ran (a metered, traced group over
# a host group is one layer). A provided method of a counted trait that ran counts for it.
#
# The bucket's bytes take these forms; a change of form is a public function of one of these
# types that takes or returns another of them by value (a borrow is no change of form).
REPRESENTATIONS = ("Tensor", "Storage", "Buffer")
#
# Events: a call into an implementation of one of these traits starts an event (the
# gradient-ready bus telling its subscribers), and so does whatever a method of one of these
# types calls (a work running its continuations when it completes: from the promise on the comm
# stream, or at once in `then` when the work had completed already, as timing decides).
EVENT_TRAITS = ("GradSubscriber",)
EVENT_CALLERS = ("Promise", "Work", "TensorPromise", "TensorWork")
# -----------------------------------------------------------------------------------------

ROOT = os.getcwd() + "/"
# callgrind's --separate-callers in gradient-way.sh: a chain this long may have been cut
SEPARATE_CALLERS = 100


def ours(path):
    """The workspace's own source file `path` names, relative to the checkout, or None."""
    if not path:
        return None
    if path.startswith(ROOT):
        path = path[len(ROOT):]
    return path if re.match(r"crates/[^/]+/src/", path) else None


class Entry:
    """One function context of the dump: the function (chain[0]) and its callers, outermost
    last, with the lines that ran in it."""

    def __init__(self, chain, file):
        self.chain = chain
        self.file = file
        self.lines = defaultdict(set)


def read_dump(path):
    """The dump's function contexts (callgrind run with --separate-callers, so that each
    function's name carries its callers) and, per file, the lines that ran."""
    names, fns = {}, {}
    entries, executed = [], defaultdict(set)
    fl = cur = None
    entry = None
    at = 0
    call = False

    def position(tok, base):
        if tok == "*":
            return base
        if tok[0] in "+-":
            return base + int(tok)
        return int(tok)

    for line in open(path, errors="replace"):
        line = line.rstrip("\n")
        m = re.match(r"(c?)(ob|fl|fi|fe|fn)=\((\d+)\)(?: (.*))?$", line)
        if m:
            callee, kind, key, name = m.groups()
            table = fns if kind == "fn" else names
            if name is not None:
                table[key] = name
            name = table.get(key)
            if callee or kind == "ob":
                continue
            if kind == "fn":
                entry = Entry(name.split("'"), fl)
                entries.append(entry)
                cur, at = fl, 0  # positions start afresh in each function
            elif kind == "fl":
                fl = cur = name
            else:
                cur = name
            continue
        if line.startswith("calls="):
            call = True  # the next line is the call's site, with the callee's inclusive cost
            continue
        m = re.match(r"([+\-]\d+|\*|\d+)\s+(\d+)", line)
        if not m:
            continue
        p = position(m.group(1), at)
        if call:
            call = False  # a call's site does not move the position the next lines count from
        else:
            at = p
        if p and int(m.group(2)) and entry is not None:
            executed[cur].add(p)
            entry.lines[cur].add(p)
    return entries, executed


def index_sources():
    """rust_items of every crate's src (test code marked), by path."""
    items = {}
    for it in rust_items.scan_all(sorted(f"crates/{c}/src" for c in os.listdir("crates")
                                         if os.path.isdir(f"crates/{c}/src"))):
        items[it.path] = it
    return items


def counted_traits(items):
    """The traits that count as dispatch layers, with their implementing types."""
    defined, types = set(), set()
    for path, it in items.items():
        if it.test_file:
            continue
        types.update(it.types)
        if path.split("/")[1] in BETWEEN_CRATES:
            defined.update(t.name for t in it.traits if not t.test)
    impls = defaultdict(set)
    for it in items.values():
        if it.test_file:
            continue
        for im in it.impls:
            if im.trait in defined and not im.test and im.self_type in types:
                impls[im.trait].add(im.self_type)
    return {t: sorted(s) for t, s in impls.items()
            if len(s) >= MIN_IMPLEMENTATIONS and t not in WRAPPER_TRAITS}


def owner_trait(fn):
    if fn.impl is not None:
        return fn.impl.trait
    if fn.trait_def is not None:
        return fn.trait_def.name
    return None


def describe(fn):
    if fn.impl is not None and fn.impl.trait:
        return f"{fn.impl.self_type}::{fn.name}"
    if fn.trait_def is not None:
        return f"{fn.trait_def.name}::{fn.name} (provided)"
    return fn.qualified


def conversions(items):
    """(path, Fn, from, to) for every change of form the sources define."""
    out = []
    for path, it in items.items():
        if it.test_file:
            continue
        for fn in it.fns:
            if fn.test or fn.decl or not fn.public or fn.impl is None or fn.impl.trait:
                continue
            own = fn.impl.self_type
            if own not in REPRESENTATIONS:
                continue
            toks = fn.signature.split()
            others = []
            for k, tok in enumerate(toks):
                if tok not in REPRESENTATIONS or tok == own:
                    continue
                j = k - 1
                while j >= 1 and toks[j] == ":" and toks[j - 1] == ":":
                    j -= 3  # a path: look before `a::b::`
                before = toks[j] if j >= 0 else ""
                if before == "mut" and j >= 1:
                    before = toks[j - 1]
                if before.startswith("'") and j >= 1:
                    before = toks[j - 1]
                if before != "&":
                    others.append(tok)
            if others:
                arrow = next((k for k in range(len(toks) - 1) if toks[k:k + 2] == ["-", ">"]), len(toks))
                returned = any(t in others for t in toks[arrow:])
                other = others[0]
                out.append((path, fn, own if returned else other, other if returned else own))
    return out


def ran(executed_lines, start, end):
    k = bisect.bisect_left(executed_lines, start)
    return k < len(executed_lines) and executed_lines[k] <= end


def changes_of_form(entries, convs, file_of):
    """(counted, nested): the conversions that ran, each `(text, path)`. One that ran only inside
    another (`lend_buffer` written as `lend_storage` then `into_buffer`) is part of that one's
    change and is listed apart. Known limit: two conversions both inlined into a third
    function's code cannot be told apart from two calls, and both count."""
    def is_conv(name):
        return any(re.search(rf"\b{fn.impl.self_type}(<[^>]*>)?>?::{fn.name}(::|$)", name) for _, fn, _, _ in convs)

    top, inner = {}, {}
    for path, fn, a, b in convs:
        key = (f"{fn.impl.self_type}::{fn.name} ({a} -> {b})", path)
        me = re.compile(rf"\b{fn.impl.self_type}(<[^>]*>)?>?::{fn.name}(::|$)")
        for e in entries:
            lines = next((sorted(ls) for f, ls in e.lines.items() if ours(f) == path), None)
            if not lines or not ran(lines, fn.start, fn.end):
                continue
            outer = e.chain[1:] if me.search(e.chain[0]) else e.chain
            host = next((n for n in outer if ours(file_of.get(n))), None)
            if host is not None and is_conv(host):
                inner[key] = True
            else:
                top[key] = True
    counted = sorted(top, key=lambda k: (k[1], k[0]))
    return counted, sorted((k for k in inner if k not in top), key=lambda k: (k[1], k[0]))


def is_event_callee(name):
    return any(re.search(rf" as [\w:]*\b{t}>::", name) for t in EVENT_TRAITS)


def is_event_caller(name):
    return any(re.search(rf"(^|[<:]){t}(<[^:]*>)?>?::", name) for t in EVENT_CALLERS)


def short(name):
    """`<a::b::Type<T> as c::Trait>::method` -> `Type::method`; `a::b::f::{{closure}}` -> `f::{{closure}}`."""
    name = re.sub(r"<([^<>]*?)(<[^<>]*>)? as [^<>]*?>", r"\1", name)
    parts = [p for p in re.sub(r"<[^<>]*>", "", name).split("::") if p]
    keep = 3 if parts and parts[-1].startswith("{{") else 2
    return "::".join(parts[-keep:])


def reentries(entries, file_of, items):
    """(counted, through_events): each a dict, file entered again -> the calls from its first
    entry to the next, `file (function) -> ...`."""
    counted, apart = {}, {}
    for e in entries:
        steps = []  # (file, function, an event starts here), outermost first
        chain = list(reversed(e.chain))
        for k, name in enumerate(chain):
            event = is_event_callee(name) or (k > 0 and is_event_caller(chain[k - 1]) and not is_event_caller(name))
            steps.append((ours(file_of.get(name)), short(name), event))
        _walk(steps, counted, apart)
        # the innermost function's inlined code from other files: entered from that function
        # (in an event when that function runs completions: a continuation inlined into it)
        inlined_event = is_event_caller(e.chain[0])
        for raw in sorted(e.lines):
            f = ours(raw)
            if f and f != ours(e.file) and f in items:
                fn = next((items[f].fn_at(line) for line in sorted(e.lines[raw]) if items[f].fn_at(line)), None)
                _walk(steps + [(f, (fn.qualified if fn else "?") + ", inlined", inlined_event)], counted, apart)
    return counted, apart


def _walk(steps, counted, apart):
    seen = {}  # file -> (index of its first step, an event came since)
    prev = None
    for k, (f, name, event) in enumerate(steps):
        if event:
            seen = {g: (at, True) for g, (at, _) in seen.items()}
        if f is None or f == prev:
            continue
        if f in seen:
            at, through_event = seen[f]
            cycle = []
            for g, n, _ in steps[at:k + 1]:
                if g and cycle and cycle[-1][0] == g:
                    cycle[-1] = (g, n)  # one step a file: its last function before it is left
                elif g:
                    cycle.append((g, n))
            text = " -> ".join(f"{g} ({n})" for g, n in cycle)
            (apart if through_event else counted).setdefault(f, text)
        else:
            seen[f] = (k, False)
        prev = f


def layer_order(layers, entries, depth, items):
    """The counted traits in the order the calls cross them: A before B when an implementation
    of A called one of B on some chain, or an implementation of A is generic over B; otherwise the higher crate first (policies, ddp, comm),
    then the shallower."""
    after = defaultdict(set)
    for e in entries:
        seen = []
        for name in reversed(e.chain):
            for t in layers:
                if re.search(rf" as [\w:]*\b{t}>::", name) and t not in seen:
                    for s in seen:
                        after[t].add(s)
                    seen.append(t)
    for it in items.values():
        for im in it.impls:
            if im.trait in layers and not im.test:
                for t in layers:
                    if t != im.trait and re.search(rf"\b{t}\b", im.header):
                        after[t].add(im.trait)  # `impl<T: B> A for X<T>`: A's calls go on to B
    rank = {c: k for k, c in enumerate(reversed(BETWEEN_CRATES))}
    order, left = [], set(layers)
    while left:
        ready = [t for t in left if not (after[t] & left)] or list(left)
        t = min(ready, key=lambda t: (rank.get(depth[t][1], 99), depth[t][0], t))
        order.append(t)
        left.remove(t)
    return order


def main(argv):
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    dump, args = argv[0], argv[1:]
    limits_file = None
    if "--check" in args:
        k = args.index("--check")
        if k + 1 >= len(args):
            print("gradient_way.py: --check needs a limits file", file=sys.stderr)
            return 2
        limits_file = args[k + 1]
    entries, executed = read_dump(dump)
    if not entries:
        print(f"gradient_way.py: {dump} holds no function: did the test run?", file=sys.stderr)
        return 1
    deepest = max(len(e.chain) for e in entries)
    if deepest > SEPARATE_CALLERS:
        print(f"gradient_way.py: a call chain is {deepest} deep, cut at {SEPARATE_CALLERS}: raise "
              f"--separate-callers in gradient-way.sh and SEPARATE_CALLERS here", file=sys.stderr)
        return 1
    items = index_sources()
    lines_of = {ours(f): sorted(ls) for f, ls in executed.items() if ours(f)}

    # files
    files = sorted(f for f in lines_of if f in items or os.path.exists(f))

    # dispatch layers
    traits = counted_traits(items)
    trait_crate = {t.name: path.split("/")[1] for path, it in items.items() for t in it.traits}
    layers = defaultdict(set)
    depth = {}
    for e in entries:
        for f, ls in e.lines.items():
            f = ours(f)
            if f not in items:
                continue
            for line in ls:
                fn = items[f].fn_at(line)
                if fn is None or fn.test:
                    continue
                t = owner_trait(fn)
                if t in traits:
                    layers[t].add(describe(fn))
                    depth[t] = (min(depth.get(t, (10 ** 6,))[0], len(e.chain)), trait_crate[t])
    order = layer_order(layers, entries, depth, items)

    # changes of form
    file_of = {}
    for e in entries:
        file_of.setdefault(e.chain[0], e.file)
    forms, nested = changes_of_form(entries, conversions(items), file_of)

    # files entered again
    counted, apart = reentries(entries, file_of, items)

    figures = {"files": len(files), "dispatch": len(order), "forms": len(forms), "reentries": len(counted)}
    print(f"files {len(files)}: the files of crates/*/src with code that ran")
    for f in files:
        print(f"    {f}")
        if "--functions" in args:
            fns = set()
            for line in lines_of[f]:
                fn = items[f].fn_at(line) if f in items else None
                fns.add(fn.qualified if fn else "(outside any function)")
            for name in sorted(fns):
                print(f"        {name}")
    print(f"dispatch {len(order)}: traits that chose an implementation between the reducer and the transport")
    for t in order:
        print(f"    {t}: {', '.join(sorted(layers[t]))}")
    print(f"forms {len(forms)}: changes of form of the bucket's bytes")
    for what, path in forms:
        print(f"    {what}  ({path})")
    if nested:
        print(f"  inside another change of form only (part of it), not counted: {len(nested)}")
        for what, path in nested:
            print(f"    {what}  ({path})")
    print(f"reentries {len(counted)}: files entered again on one call chain, outside an event")
    for f in sorted(counted):
        print(f"    {f}: {counted[f]}")
    if apart:
        print(f"  through an event ({', '.join(EVENT_TRAITS + EVENT_CALLERS)}), not counted: {len(apart)}")
        for f in sorted(apart):
            print(f"    {f}: {apart[f]}")

    if limits_file is None:
        return 0
    return ratchet.check(figures, limits_file, "gradient-way")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
