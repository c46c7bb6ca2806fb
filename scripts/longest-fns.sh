#!/usr/bin/env bash
# The longest functions, in lines from the `fn` line to the brace that closes its body, one a
# line: `LINES FILE:LINE NAME`, longest first, the top N (default 25).
# PATHS are files or folders (default: crates); under a folder, tests/, examples/, benches/ and
# tests.rs files are left out, and so everywhere is test code (`#[test]`, `#[cfg(test)]` modules
# and items, files such a module declares). Declarations without a body have no length.
# The scanner is scripts/rust_items.py (comments, strings and char literals skipped).
# Usage: scripts/longest-fns.sh [N] [PATHS...]   e.g. scripts/longest-fns.sh 5 crates/ddp/src
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
n=25
if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; then
  n="$1"
  shift
fi
[ $# -gt 0 ] || set -- crates
list="$(python3 "$here/rust_items.py" fns "$@")"
printf '%s\n' "$list" | sed '/^$/d' | sort -k1,1nr -k2,2 | awk -v n="$n" 'NR <= n'
