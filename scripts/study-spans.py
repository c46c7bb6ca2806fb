#!/usr/bin/env python3
"""Where does a study's predicted step differ from the step measured on the simulated link?

For one policy, world size and link, runs `study-validation.py`'s run twice with `--profile`
(steps 2..STEPS): on the machine's own link (what `brigade study` profiles) and on the thread
backend's simulated link (what it is measured against), then prints, span by span, the median
over the profiled steps of each rank's recorded times (ms from the step's start: forward,
backward's end, the wait for the buckets, the agreement on the loss, the optimizer, the
buckets' time on the link, the policy's compute), and the step each profile predicts on the
stated link (`brigade predict`, the median step) against the measured step (`--json`'s
`step_ms`, median). The own profile's prediction is the study's; the simulated profile's
differs from it by what the run on the link computed differently, and from the measured step
by what the link delivered beyond its ring time.

    scripts/study-spans.py --policy fp16 --world 2 --link 1:20
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

RUN = [
    "--model", "mlp", "--widths", "128,512,512,10", "--batch-size", "32",
    "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05",
]


def brigade(binary, args):
    p = subprocess.run([binary] + args, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"error: brigade {' '.join(args)} failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(p.stdout)


def spans(rank):
    waited = max([b["finish_s"] for b in rank["buckets"]] + [rank["backward_end_s"]])
    policy = rank.get("policy_s") or {}
    return {
        "forward": rank["backward_start_s"],
        "backward end": rank["backward_end_s"],
        "buckets waited until": waited,
        "agreement on the loss": rank["optimizer_start_s"] - waited,
        "optimizer": rank["optimizer_end_s"] - rank["optimizer_start_s"],
        "step end": rank["step_end_s"],
        "buckets on the link": sum(b.get("link_s") or 0.0 for b in rank["buckets"]),
        "policy's reduce": policy.get("reduce_s", 0.0),
        "agreement's link (recorded)": sum(c["link_s"] for c in rank.get("control", [])),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default="target/release/brigade")
    ap.add_argument("--policy", default="allreduce")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--link", default="1:20", help="GBPS:LATENCY_US")
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    gbps, _, us = a.link.partition(":")
    link = ["--net-gbps", gbps, "--net-latency-us", us or "0"]
    base = ["train"] + RUN + ["--world-size", str(a.world), "--steps", str(a.steps), "--policy", a.policy,
                              "--json", "--quiet", "--profile-steps", f"2..{a.steps}"]
    print(f"load average before: {'%.2f %.2f %.2f' % os.getloadavg()}")
    rows, steps = {}, {}
    with tempfile.TemporaryDirectory(prefix="study-spans-") as tmp:
        for name, extra in (("own link", []), ("simulated link", link)):
            path = os.path.join(tmp, name.replace(" ", "-") + ".json")
            run = brigade(a.bin, base + extra + ["--profile", path])
            profiles = json.load(open(path))
            per_rank = [[spans(p["ranks"][r]) for p in profiles] for r in range(a.world)]
            rows[name] = {k: [statistics.median(s[k] for s in rs) for rs in per_rank] for k in per_rank[0][0]}
            pred = brigade(a.bin, ["predict", "--profile", path, "--json", "--bucket-mb", "25"] + link)[0]
            steps[name] = (pred["predicted_step_s"], statistics.median(run["step_ms"][2:]) / 1e3)
    print(f"load average after: {'%.2f %.2f %.2f' % os.getloadavg()}\n")
    print(f"{a.policy}, {a.world} ranks, {gbps} Gb/s {us} us: medians over steps 2..{a.steps}, ms, rank by rank\n")
    print("| span | own link | simulated link |")
    print("|---|---|---|")
    for k in rows["own link"]:
        cell = lambda name: " / ".join(f"{1e3 * v:.3f}" for v in rows[name][k])
        print(f"| {k} | {cell('own link')} | {cell('simulated link')} |")
    (own_pred, _), (sim_pred, measured) = steps["own link"], steps["simulated link"]
    print(f"\npredicted on the link from the own profile (the study's): {1e3 * own_pred:.3f} ms")
    print(f"predicted on the link from the simulated profile: {1e3 * sim_pred:.3f} ms")
    print(f"measured on the simulated link: {1e3 * measured:.3f} ms "
          f"(own profile {100 * (own_pred - measured) / measured:+.1f}%, "
          f"simulated profile {100 * (sim_pred - measured) / measured:+.1f}%)")


if __name__ == "__main__":
    main()
