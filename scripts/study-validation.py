#!/usr/bin/env python3
"""Does `brigade study` predict the time to a target loss that a run on the link measures?

For each world size and link: (a) `brigade study` trains every policy on thread ranks on the
machine's own link and predicts its step on the link (`--predict-gbps`, `--predict-latency-us`);
the predicted time to a target is the steps to it (from the study's losses) times the
predicted step. (b) The measurement: `brigade train` of the same run on the thread backend's
simulated link (`--net-gbps`, `--net-latency-us`; it sleeps each collective's ring time), up
to the step that reaches the last target; the measured time to a target is the sum of its
steps' wall times (`--json`'s `step_ms`, rank 0). Both count from the end of the study's
warm-up steps (its first WARMUP, which it does not profile: the first step builds the buckets
and warms the caches, 0.3-0.5 s here, a start-up cost of the process and not of the policy):
predicted (n - WARMUP) x step, measured the steps WARMUP..n; the warm-up steps' own measured
time is printed beside them. The simulated link only delays: the run's
losses must equal the study's bit for bit (checked; the script stops otherwise), so the two
differ in their time axis alone.

Prints a markdown table (policy, world, link, target, steps to it, predicted and measured
seconds, the error, the policy's rank by predicted and by measured time among the policies
that reach the target), the CPU and the load average before and after; then how many
predictions are within 10%, where the rankings differ, and for how many pairs of policies whose
measured times differ by more than their error bands (each widened by its policy's band from
replaying its own profiles, the two disjoint) the predicted order is the measured one. `--repeat N` runs
each study and each measurement N times (interleaved) and takes the medians.

    scripts/study-validation.py                    # release build, defaults below
    scripts/study-validation.py --repeat 3 --json out.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

POLICIES = "allreduce,fp16,powersgd:4,topk:0.01,diloco:10"
# the steps a study leaves out of its profile (`StudyConfig::new`'s warm-up)
WARMUP = 2
# the issue's run: an MLP 128-512-512-10, batch 32, SGD momentum 0.9, lr 0.05
RUN = [
    "--model", "mlp", "--widths", "128,512,512,10", "--batch-size", "32",
    "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05",
]


def cpu_name():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return "unknown CPU"


def load():
    return "%.2f %.2f %.2f" % os.getloadavg()


def brigade(binary, args, timeout):
    """Runs brigade with `args`, returns its stdout as JSON; one line and exit on failure."""
    try:
        p = subprocess.run([binary] + args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.exit(f"error: brigade {' '.join(args)} ran past {timeout} s")
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no message)"])[-1]
        sys.exit(f"error: brigade {' '.join(args)} failed: {last}")
    return json.loads(p.stdout)


def reach(losses, target):
    """Steps run up to and including the first whose loss is at most `target` (None: never)."""
    for i, l in enumerate(losses):
        if l is not None and l <= target:
            return i + 1
    return None


def ranks(values):
    """Each key's rank (1 = smallest value) among those with a value."""
    order = sorted((v, k) for k, v in values.items() if v is not None)
    return {k: i + 1 for i, (_, k) in enumerate(order)}


def study(a, world, links, out):
    args = ["study"] + RUN + [
        "--world-size", str(world), "--steps", str(a.steps), "--policy", a.policies,
        "--predict-gbps", ",".join(str(g) for g, _ in links),
        "--predict-latency-us", ",".join(str(us) for _, us in links),
        "--target-loss", ",".join(str(t) for t in a.targets),
        "--out", out, "--json",
    ]
    results = brigade(a.bin, args, a.timeout)
    for r in results:
        band = r.get("own_band")
        if band:
            a.bands.setdefault((world, r["policy"]), []).append(max(abs(band["low"]), abs(band["high"])))
    by = {}
    for r in results:
        for p in r["predictions"]:
            if p["world_size"] == world:
                key = (r["policy"], p["net_gbps"], p["net_latency_us"])
                by[key] = p["step_s"]
    return {r["policy"]: r["losses"] for r in results}, by


def measure(a, world, policy, link, steps):
    g, us = link
    args = ["train"] + RUN + [
        "--world-size", str(world), "--steps", str(steps), "--policy", policy,
        "--net-gbps", str(g), "--net-latency-us", str(us), "--json", "--quiet",
    ]
    run = brigade(a.bin, args, a.timeout)
    return run["loss"], run["step_ms"]


def parse_links(text):
    links = []
    for item in text.split(","):
        g, _, us = item.partition(":")
        links.append((float(g), float(us or 0)))
    return links


def validate(a, world, links, tmp):
    """The rows of one world: every policy, link and target."""
    losses, steps_s = None, {}
    for k in range(a.repeat):
        l, s = study(a, world, links, os.path.join(tmp, f"study-{world}-{k}"))
        if losses is not None and l != losses:
            sys.exit(f"error: two studies at {world} ranks trained to different losses")
        losses = l
        for key, v in s.items():
            steps_s.setdefault(key, []).append(v)
    rows = []
    for link in links:
        measured = {}
        for policy, ls in losses.items():
            needed = [n for n in (reach(ls, t) for t in a.targets) if n is not None]
            if not needed:
                continue
            runs = []
            for _ in range(a.repeat):
                got, ms = measure(a, world, policy, link, max(needed))
                if got != ls[: len(got)]:
                    sys.exit(f"error: {policy} at {world} ranks on {link}: the run on the simulated link "
                             "lost other losses than the study's (the link should only delay)")
                runs.append(ms)
            measured[policy] = runs
        for t in a.targets:
            pred, meas, steps, warm = {}, {}, {}, {}
            for policy, ls in losses.items():
                n = reach(ls, t)
                steps[policy] = n
                step = [s for s in steps_s.get((policy, link[0], link[1]), []) if s is not None]
                # counted from the end of the warm-up steps (a target reached during them: 0 s)
                counted = max(n - WARMUP, 0) if n else None
                pred[policy] = counted * statistics.median(step) if n and step else None
                meas[policy] = (statistics.median(sum(ms[WARMUP:n]) / 1e3 for ms in measured[policy])
                                if n else None)
                warm[policy] = (statistics.median(sum(ms[:WARMUP]) / 1e3 for ms in measured[policy])
                                if policy in measured else None)
            rp, rm = ranks(pred), ranks(meas)
            for policy in losses:
                p, m = pred[policy], meas[policy]
                rows.append({
                    "policy": policy, "world": world, "gbps": link[0], "latency_us": link[1],
                    "target": t, "steps": steps[policy], "predicted_s": p, "measured_s": m,
                    "error": (p - m) / m if p is not None and m else None,
                    "warmup_s": warm[policy],
                    "rank_predicted": rp.get(policy), "rank_measured": rm.get(policy),
                    "band": max(a.bands.get((world, policy), [None]), key=lambda b: b or 0.0),
                })
    return rows


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(rows):
    print(f"| policy | world | link | target | steps to target | predicted s | measured s | error "
          f"| rank predicted/measured | first {WARMUP} steps, measured s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        link = f"{r['gbps']:g} Gb/s {r['latency_us']:g} us"
        rank = f"{fmt(r['rank_predicted'], 'd')}/{fmt(r['rank_measured'], 'd')}"
        err = fmt(None if r["error"] is None else 100 * r["error"], "+.1f")
        print(f"| {r['policy']} | {r['world']} | {link} | {r['target']:g} | {fmt(r['steps'], 'd')} "
              f"| {fmt(r['predicted_s'], '.3f')} | {fmt(r['measured_s'], '.3f')} "
              f"| {err if err == '-' else err + '%'} | {rank} | {fmt(r['warmup_s'], '.3f')} |")


def summary(rows):
    """The worst error, and the (world, link, target)s whose rankings differ."""
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    groups = {}
    for r in rows:
        groups.setdefault((r["world"], r["gbps"], r["latency_us"], r["target"]), []).append(r)
    swapped = [k for k, rs in groups.items() if any(r["rank_predicted"] != r["rank_measured"] for r in rs)]
    within = sum(e <= 0.10 for e in errors)
    print(f"\nwithin 10%: {within} of {len(errors)}; worst |error| {fmt(max(errors, default=None), '.1%')}")
    print("ranking preserved in every world, link and target" if not swapped else
          "ranking differs at: " + "; ".join(f"{w} ranks, {g:g} Gb/s {us:g} us, target {t:g}"
                                             for w, g, us, t in swapped))
    # the issue's criterion: the order kept wherever the measured times differ by more than the
    # policies' error bands (each measured time widened by its policy's band, the two disjoint)
    apart, kept, lost = 0, 0, []
    for (w, g, us, t), rs in groups.items():
        rs = [r for r in rs if r["measured_s"] is not None and r["predicted_s"] is not None]
        for i, x in enumerate(rs):
            for y in rs[i + 1:]:
                lo, hi = sorted((x, y), key=lambda r: r["measured_s"])
                if lo["measured_s"] * (1 + (lo["band"] or 0)) >= hi["measured_s"] * (1 - (hi["band"] or 0)):
                    continue
                apart += 1
                if lo["predicted_s"] < hi["predicted_s"]:
                    kept += 1
                else:
                    lost.append(f"{lo['policy']} before {hi['policy']} ({w} ranks, {g:g} Gb/s {us:g} us, "
                                f"target {t:g})")
    print(f"order kept for {kept} of {apart} pairs whose measured times differ by more than their error bands"
          + ("" if not lost else "; swapped: " + "; ".join(lost)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default="target/release/brigade", help="the brigade binary (release)")
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    ap.add_argument("--links", default="1:20,0.25:100",
                    help="links as GBPS:LATENCY_US, comma-separated (default 1 Gb/s 20 us and 0.25 Gb/s 100 us)")
    ap.add_argument("--steps", type=int, default=200, help="steps each study trains")
    ap.add_argument("--targets", default="0.8,0.6", help="target losses, comma-separated")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each study and measurement (medians)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds any one brigade run may take")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    a.bands = {}
    a.targets = [float(t) for t in a.targets.split(",")]
    if a.repeat < 1 or a.steps < 3:
        sys.exit("error: --repeat must be at least 1 and --steps at least 3")
    if not os.access(a.bin, os.X_OK):
        sys.exit(f"error: {a.bin} is not an executable: cargo build --release -p brigade-cli")
    links = parse_links(a.links)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load average before: {load()}")
    start = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="study-validation-") as tmp:
        for world in (int(w) for w in a.worlds.split(",")):
            rows += validate(a, world, links, tmp)
    print(f"load average after: {load()}; {time.monotonic() - start:.0f} s\n")
    table(rows)
    summary(rows)
    if a.json:
        tmp_path = a.json + ".tmp"
        with open(tmp_path, "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp_path, a.json)


if __name__ == "__main__":
    main()
