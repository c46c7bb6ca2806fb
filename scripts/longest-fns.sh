#!/usr/bin/env bash
# The longest functions of the given Rust files, in lines from the `fn` line to its closing brace
# at the same indent: `scripts/longest-fns.sh crates/brigade/src/trainer/*.rs`.
awk 'FNR==1{open=0} !open && match($0,/^ *(pub(\([a-z]+\))? )?fn [a-z_0-9]+/){ind=RSTART; m=$0; sub(/^ */,"",m); ind=length($0)-length(m); name=m; sub(/\(.*/,"",name); start=FNR; open=1; if ($0 ~ /;$/) open=0; next}
open { m=$0; sub(/^ */,"",m); if (m=="}" && length($0)-length(m)==ind) {print FNR-start+1, FILENAME": "name; open=0} }' "$@" | sort -rn | head -5
