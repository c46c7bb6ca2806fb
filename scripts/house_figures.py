#!/usr/bin/env python3
"""The house's static figures, read from the sources (see scripts/house-figures.sh):

policy-literals  files of crates/*/src outside crates/policies whose non-test code names a
                 built-in policy in a string literal (as a word: `"zero3"`, `"powersgd:4"`, a
                 message naming `fp16`; comments are not code); a dtype or a precision spelled
                 like a policy (`bf16`) is allowed by scripts/house-figures.allow, line by line
                 with its reason;
flags            Brigade's own command-line flags (those `brigade ... --help` lists) spelled in
                 string literals of the non-test code of crates/brigade/src (another program's
                 flags, such as mpirun's `--bind-to`, are not Brigade's);
longest-fn       the longest function of crates/ outside tests (scripts/longest-fns.sh 1);
and, printed but not held to a limit (every change of the public API adds a line to
docs/CHANGELOG.md), the line counts of README.md, docs/ARCHITECTURE.md and the summary table at the top
of docs/BENCHMARKS.md (the first table of a first section named Today, Summary or Current).

Usage: house_figures.py BRIGADE_BINARY [--check LIMITS] [--allow ALLOW]
"""

import fnmatch
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ratchet  # noqa: E402
import rust_items  # noqa: E402

POLICIES_SRC = "crates/policies/src"
LIBRARY_SRC = "crates/brigade/src"


def built_in_policy_names():
    """The names of the built-in policies, read where the policies crate lists them: the entries
    of its registry (`Entry { name: "..", .. }` or `Entry::new("..", ..)` in registry.rs), else
    its `BUILT_IN` list. If neither is found this fails, so that a new way of listing them is
    taught here rather than silently counting nothing."""
    names = []
    registry = os.path.join(POLICIES_SRC, "registry.rs")
    if os.path.exists(registry):
        toks = rust_items.tokens(open(registry).read())
        for k, t in enumerate(toks):
            if t.text != "Entry" or k + 2 >= len(toks):
                continue
            if toks[k + 1].text == "{":
                depth = 0
                for j in range(k + 1, len(toks)):
                    if toks[j].text in "{([":
                        depth += 1
                    elif toks[j].text in "})]":
                        depth -= 1
                        if depth == 0:
                            break
                    elif depth == 1 and toks[j].text == "name" and toks[j + 1].text == ":" and toks[j + 2].kind == "str":
                        names.append(toks[j + 2].text)
                        break
            elif toks[k + 1].text == ":" and k + 5 < len(toks) and toks[k + 3].kind == "ident" \
                    and toks[k + 4].text == "(" and toks[k + 5].kind == "str":
                names.append(toks[k + 5].text)
    if not names:
        for path in rust_items.rust_files([POLICIES_SRC]):
            toks = rust_items.tokens(open(path).read())
            for k, t in enumerate(toks):
                if t.text == "BUILT_IN" and k > 0 and toks[k - 1].text == "const":
                    j = next(j for j in range(k, len(toks)) if toks[j].text == "=")
                    while j < len(toks) and toks[j].text != ";":
                        if toks[j].kind == "str":
                            names.append(toks[j].text)
                        j += 1
    names = sorted({n.strip('"') for n in names if re.fullmatch(r'"[A-Za-z][A-Za-z0-9_-]*"', n)})
    if not names:
        sys.exit(f"house-figures: found no built-in policy names in {POLICIES_SRC} (neither a registry "
                 f"entry's name nor a BUILT_IN list): teach built_in_policy_names() in {__file__} where they are")
    return names


def read_allow(path):
    """(glob, name, regex or None, reason) per line of the allow file."""
    rules = []
    for n, raw in enumerate(open(path).read().splitlines(), 1):
        line, _, why = raw.partition("#")
        parts = line.split(None, 2)
        if not parts:
            continue
        if len(parts) < 2 or not why.strip():
            sys.exit(f"house-figures: {path}:{n}: expected `PATH-GLOB NAME [REGEX] # why`, found `{raw.strip()}`")
        regex = re.compile(parts[2].strip()) if len(parts) == 3 else None
        rules.append((parts[0], parts[1], regex, why.strip()))
    return rules


def non_test_strings(paths):
    for it in rust_items.scan_all(paths):
        if it.test_file:
            continue
        for line, text, test, _ in it.strings:
            if not test:
                yield it.path, line, text


def policy_literals(names, allow):
    word = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(map(re.escape, names)) + r")(?![A-Za-z0-9])")
    srcs = sorted(f"crates/{c}/src" for c in os.listdir("crates")
                  if os.path.isdir(f"crates/{c}/src") and f"crates/{c}/src" != POLICIES_SRC)
    found, allowed = {}, 0
    for path, line, text in non_test_strings(srcs):
        named = set(word.findall(text))
        kept = {n for n in named if not any(fnmatch.fnmatch(path, g) and n == name and (rx is None or rx.search(text))
                                           for g, name, rx, _ in allow)}
        allowed += len(named) - len(kept)
        if kept:
            found.setdefault(path, []).append((line, sorted(kept), text))
    return found, allowed


def brigade_flags(binary):
    """Every long flag of every `brigade` command, from its --help."""
    def helps(args):
        out = subprocess.run([binary, *args, "--help"], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            sys.exit(f"house-figures: `{binary} {' '.join(args)} --help` failed: {out.stderr.strip()[:200]}")
        text = out.stdout
        flags = set(re.findall(r"^\s+(?:-\w, )?--([a-z0-9][a-z0-9-]*)", text, re.M))
        section = re.search(r"^Commands:\n((?:  .*\n)+)", text, re.M)
        for name in re.findall(r"^  (\S+)", section.group(1), re.M) if section else []:
            if name != "help":
                flags |= helps(args + [name])
        return flags
    return helps([]) - {"help", "version"}


def flags_in_library(flags):
    spelled = re.compile(r"(?<![A-Za-z0-9-])--([a-z0-9][a-z0-9-]*)")
    out = []
    for path, line, text in non_test_strings([LIBRARY_SRC]):
        for f in spelled.findall(text):
            if f in flags:
                out.append((path, line, f"--{f}"))
    return out


def longest_fn():
    fns = [(f.lines, it.path, f.start, f.qualified)
           for it in rust_items.scan_all(["crates"]) if not it.test_file
           for f in it.fns if not f.test and not f.decl]
    return max(fns, key=lambda x: (x[0], [-ord(c) for c in x[1]]))


def lines_of(path):
    try:
        return sum(1 for _ in open(path))
    except OSError:
        return None


def summary_table(path="docs/BENCHMARKS.md"):
    """(heading, lines of its first table) of BENCHMARKS' first section when it is the summary."""
    try:
        text = open(path).read().splitlines()
    except OSError:
        return None, None
    first = next((k for k, l in enumerate(text) if l.startswith("## ")), None)
    if first is None or not re.match(r"## (Today|Summary|Current)\b", text[first], re.I):
        return (text[first][3:] if first is not None else None), None
    rows, k = 0, first + 1
    while k < len(text) and not text[k].startswith("## "):
        if text[k].startswith("|"):
            rows += 1
        elif rows:
            break
        k += 1
    return text[first][3:], rows


def main(argv):
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    binary, args = argv[0], argv[1:]
    opt = lambda name, default=None: args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else default
    allow = read_allow(opt("--allow", os.path.join(HERE, "house-figures.allow")))

    names = built_in_policy_names()
    literals, allowed = policy_literals(names, allow)
    print(f"policy-literals {len(literals)}: files outside {POLICIES_SRC} whose non-test code names a built-in "
          f"policy ({', '.join(names)}) in a string literal ({allowed} spellings of a dtype or precision allowed)")
    for path in sorted(literals):
        print(f"    {path}: " + ", ".join(f"{line} ({'/'.join(ns)})" for line, ns, _ in literals[path]))

    spelled = flags_in_library(brigade_flags(binary))
    print(f"flags {len(spelled)}: Brigade's own flags spelled in non-test code of {LIBRARY_SRC}")
    for path, line, flag in spelled:
        print(f"    {path}:{line} {flag}")

    n, path, start, name = longest_fn()
    print(f"longest-fn {n}: {path}:{start} {name} (crates/, outside tests)")

    heading, rows = summary_table()
    print(f"README.md {lines_of('README.md')} lines; docs/ARCHITECTURE.md {lines_of('docs/ARCHITECTURE.md')} lines; "
          + (f"docs/BENCHMARKS.md's summary table ({heading}) {rows} lines" if rows is not None else
             f"docs/BENCHMARKS.md has no summary table first (its first section: {heading})"))

    limits = opt("--check")
    if limits is None:
        return 0
    return ratchet.check({"policy-literals": len(literals), "flags": len(spelled), "longest-fn": n}, limits, "house-figures")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
