"""A ratchet on figures that may only fall: scripts/gradient-way.sh and scripts/house-figures.sh
hold their figures to a limits file (`NAME LIMIT` a line, `#` starts a comment)."""

import sys


def check(figures, limits_file, who):
    """Fails (1) when a figure is above its limit or the file lacks one; says which limits can come
    down (a figure below its limit passes: lower the limit in the commit that lowered it)."""
    try:
        text = open(limits_file).read()
    except OSError as e:
        print(f"{who}: cannot read the limits {limits_file}: {e.strerror}", file=sys.stderr)
        return 1
    limits = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or parts[0] not in figures or not parts[1].isdigit():
            print(f"{who}: {limits_file}:{n}: expected `NAME LIMIT` with NAME one of {', '.join(figures)}, "
                  f"found `{raw.strip()}`", file=sys.stderr)
            return 1
        limits[parts[0]] = int(parts[1])
    missing = [name for name in figures if name not in limits]
    if missing:
        print(f"{who}: {limits_file} has no limit for {', '.join(missing)}", file=sys.stderr)
        return 1
    failed = False
    for name, value in figures.items():
        if value > limits[name]:
            print(f"{who}: {name} {value} is above its limit {limits[name]} ({limits_file})", file=sys.stderr)
            failed = True
        elif value < limits[name]:
            print(f"{who}: {name} {value} is below its limit {limits[name]}: lower the limit to {value} in {limits_file}")
    if not failed:
        print(f"{who}: within the limits of {limits_file}")
    return 1 if failed else 0
