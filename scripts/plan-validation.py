#!/usr/bin/env python3
"""`brigade plan` against measurement: the table of docs/BENCHMARKS.md's plan section.

For each setting (the reference MLP and GPT at 2 ranks, the MLP at 4; simulated links of 1 and
10 Gb/s with 20 us per message):
  1. calibration: one short profiled run per policy family (`brigade train --profile`, 5 steps,
     steps 2-4 profiled, the plan reading their median: allreduce, fp16, bf16, powersgd:1@0,
     zero1, zero2, zero3, and for the GPT allreduce with every block checkpointed), the same runs
     `--plan auto` makes;
  2. the plan (`brigade plan --json`) under a budget set to the median of the candidates'
     predicted peaks (so that about half of them are struck out), over caps 1, 5 and 25 MiB;
  3. every candidate that fits and was predicted, measured: `brigade train` with its flags,
     --steps STEPS --untimed-steps WARMUP, REPEAT times round-robin (all candidates once, then
     again), so that the machine's drift touches every candidate alike; the median step and the
     measured peak per rank (`memory.peak_bytes`, plus `memory.policy_state_bytes`: PowerSGD's
     error feedback and factors live on the comm stream's thread, outside the meter's peak, and
     the plan counts them);
  4. per candidate the predicted against the measured step and peak; per setting the plan's
     pick against the fastest measured candidate;
  5. the confirmation: the fastest of a dozen noisy medians is biased fast (the winner's
     curse), so the pick and the best measured (when they differ) are measured again, head to
     head, CONFIRM more times each, interleaved; pick / best is given from the sweep and from
     these independent runs.
With --memory-grid, only the memory model: the reference MLP and GPT at world 1, 2, 4 and 8 under
zero 0, 1, 2 and 3, the GPT with and without activation checkpointing (every block), each run
`brigade train --steps 3 --json` once; its predicted peak (`memory.predicted_peak_bytes`) against
its measured whole-run peak (`memory.peak_bytes`, with the parts that held it), and the worst
errors. No timing: any load will do. With --reuse FILE (an earlier run's memory-grid.json), the
measured peaks are taken from it and the predictions asked of BIN without training (the
`--memory-budget 0.001` refusal names the predicted peak): for a change to the model alone.
One MPI row (with mpirun on PATH and a build with --features mpi): the MLP at 2 ranks under
mpirun, its allreduce and zero2 profiles recorded under MPI, the plan under --measured-link,
the pick and allreduce measured under mpirun.

Timing means nothing on a loaded machine: run it alone (about 15-25 minutes on 2 cores).

Usage: scripts/plan-validation.py [--out DIR] [--repeat 3] [--steps 8] [--warmup 3] [--confirm 5]
         [--settings mlp-w2,gpt-w2,mlp-w4] [--gbps 1,10] [--brigade BIN] [--mpi-brigade BIN]
         [--no-mpi] [--smoke] [--memory-grid [--reuse FILE]]   (tiny models, 1 repeat: checks that the script runs, measures nothing)
Writes DIR/plan-validation.json and prints the markdown table.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

LATENCY_US = 20
CAPS = "1,5,25"

MODELS = {
    # the reference MLP (36.1 MiB of gradients) and GPT (4 x 128 tokens per rank)
    "mlp": ["--model", "mlp", "--batch-size", "64"],
    "gpt": ["--model", "gpt", "--batch-size", "4"],
}
SMOKE_MODELS = {
    "mlp": ["--model", "mlp", "--widths", "64,256,256,4", "--batch-size", "8"],
    "gpt": ["--model", "gpt", "--d-model", "32", "--layers", "2", "--heads", "2", "--d-ff", "64",
            "--context", "16", "--batch-size", "2"],
}


def calibrations(model):
    runs = [["--policy", p] for p in ("allreduce", "fp16", "bf16", "powersgd:1@0", "zero1", "zero2", "zero3")]
    if model == "gpt":
        runs.append(["--policy", "allreduce", "--activation-checkpointing", "1"])
    return runs


def sh(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    return r.stdout


def candidate_flags(c):
    f = ["--policy", c["policy"], "--bucket-mb", str(c["bucket_cap_mb"]),
         "--first-bucket-mb", str(c["first_bucket_cap_mb"])]
    if c["activation_checkpointing"]:
        f += ["--activation-checkpointing", str(c["activation_checkpointing"])]
    return f


def name_of(c):
    ac = f" ac{c['activation_checkpointing']}" if c["activation_checkpointing"] else ""
    return f"{c['policy']} {c['bucket_cap_mb']:g} MiB{ac}"


def plan(brigade, profiles, budget_mb, link):
    out = sh([brigade, "plan", "--profile", ",".join(profiles), "--memory-budget", str(budget_mb),
              "--bucket-mb", CAPS, "--json"] + link)
    return json.loads(out)


def setting(a, brigade, out, model, world, gbps, launcher=(), backend=()):
    name = f"{model}-w{world}-{gbps}gbps" if gbps else f"{model}-w{world}-mpi"
    link = ["--net-gbps", str(gbps), "--net-latency-us", str(LATENCY_US)] if gbps else []
    common = (SMOKE_MODELS if a.smoke else MODELS)[model] + ["--world-size", str(world)] + list(backend) + link
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    print(f"== {name}: calibrating", file=sys.stderr)
    profiles = []
    for i, cal in enumerate(calibrations(model)):
        if gbps is None and cal[1] not in ("allreduce", "zero1", "zero2"):
            continue
        p = os.path.join(d, f"profile-{i}.json")
        sh(list(launcher) + [brigade, "train"] + common + cal +
           ["--steps", "5", "--profile-steps", "2..5", "--quiet", "--profile", p])
        profiles.append(p)
    plan_link = link if gbps else ["--measured-link"]
    wide = plan(brigade, profiles, 1 << 20, plan_link)
    totals = sorted(c["memory"]["total"] for c in wide["candidates"])
    budget_mb = statistics.median(totals) / (1 << 20)
    p = plan(brigade, profiles, budget_mb, plan_link)
    cands = [c for c in p["candidates"] if c["fits"] and c["step"]]
    if gbps is None:
        # the MPI row: the pick and the allreduce candidates
        cands = [c for i, c in enumerate(p["candidates"])
                 if c["fits"] and c["step"] and (i == p["winner"] or c["policy"] == "allreduce")]
    print(f"== {name}: budget {budget_mb:.2f} MiB, {len(cands)} of {len(p['candidates'])} candidates fit and "
          f"are predicted; measuring each {a.repeat}x", file=sys.stderr)
    steps = {name_of(c): [] for c in cands}
    peaks = {name_of(c): [] for c in cands}

    def measure(c):
        js = json.loads(sh(list(launcher) + [brigade, "train"] + common + candidate_flags(c) +
                           ["--steps", str(a.steps), "--untimed-steps", str(a.warmup), "--quiet", "--json"]))
        mem = js["memory"]
        return js["median_step_ms"], mem["peak_bytes"] + (mem.get("policy_state_bytes") or 0)

    for r in range(a.repeat):
        for c in cands:
            ms, peak = measure(c)
            steps[name_of(c)].append(ms)
            peaks[name_of(c)].append(peak)
    rows = []
    for i, c in enumerate(p["candidates"]):
        row = {"candidate": name_of(c), "fits": c["fits"], "winner": i == p["winner"],
               "predicted_step_ms": c["step"]["step_s"] * 1e3 if c["step"] else None,
               "not_predicted": c["not_predicted"], "predicted_peak_bytes": c["memory"]["total"],
               "over_budget": c["over_budget"]}
        m = steps.get(name_of(c))
        if m:
            row["measured_step_ms"] = statistics.median(m)
            row["measured_spread_ms"] = max(m) - min(m)
            row["measured_peak_bytes"] = int(statistics.median(peaks[name_of(c)]))
        rows.append(row)
    measured = [r for r in rows if "measured_step_ms" in r]
    best = min(measured, key=lambda r: r["measured_step_ms"]) if measured else None
    pick = next((r for r in rows if r["winner"]), None)
    confirmed = None
    if pick and best and "measured_step_ms" in pick:
        confirmed = 1.0
        if pick is not best and a.confirm > 0:
            by_name = {name_of(c): c for c in cands}
            print(f"== {name}: confirming {pick['candidate']} against {best['candidate']} {a.confirm}x",
                  file=sys.stderr)
            again = {pick["candidate"]: [], best["candidate"]: []}
            for _ in range(a.confirm):
                for n in again:
                    again[n].append(measure(by_name[n])[0])
            confirmed = statistics.median(again[pick["candidate"]]) / statistics.median(again[best["candidate"]])
            pick["confirmed_step_ms"] = statistics.median(again[pick["candidate"]])
            best["confirmed_step_ms"] = statistics.median(again[best["candidate"]])
    return {"setting": name, "budget_mb": budget_mb, "rows": rows,
            "best_measured": best and best["candidate"], "pick": pick and pick["candidate"],
            "pick_vs_best": (pick["measured_step_ms"] / best["measured_step_ms"]
                             if pick and best and "measured_step_ms" in pick else None),
            "pick_vs_best_confirmed": confirmed}


def pct(a, b):
    return f"{(a / b - 1) * 100:+.1f}%" if a is not None and b else ""


def mib(b):
    return f"{b / (1 << 20):.1f}"


def table(results):
    lines = []
    for s in results:
        lines.append(f"\n**{s['setting']}**, budget {s['budget_mb']:.1f} MiB per rank: pick `{s['pick']}`, best "
                     f"measured `{s['best_measured']}`, pick/best {s['pick_vs_best']:.3f} in the sweep, "
                     f"{s['pick_vs_best_confirmed']:.3f} confirmed" if s["pick_vs_best"]
                     else f"\n**{s['setting']}**, budget {s['budget_mb']:.1f} MiB: pick `{s['pick']}`")
        lines.append("")
        lines.append("| candidate | predicted ms | measured ms (spread) | step error | predicted peak MiB | "
                     "measured peak MiB | peak error |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in s["rows"]:
            name = ("**" + r["candidate"] + "** (pick)") if r["winner"] else r["candidate"]
            if not r["fits"]:
                ob = r["over_budget"]
                lines.append(f"| ~~{r['candidate']}~~ | | | | {mib(r['predicted_peak_bytes'])} | | over by "
                             f"{mib(ob['bytes'])} MiB in {ob['part']} |")
            elif r["predicted_step_ms"] is None:
                lines.append(f"| {r['candidate']} | not predicted: {r['not_predicted']} | | | "
                             f"{mib(r['predicted_peak_bytes'])} | | |")
            elif "measured_step_ms" in r:
                lines.append(f"| {name} | {r['predicted_step_ms']:.1f} | {r['measured_step_ms']:.1f} "
                             f"({r['measured_spread_ms']:.1f}) | {pct(r['predicted_step_ms'], r['measured_step_ms'])} | "
                             f"{mib(r['predicted_peak_bytes'])} | {mib(r['measured_peak_bytes'])} | "
                             f"{pct(r['predicted_peak_bytes'], r['measured_peak_bytes'])} |")
    return "\n".join(lines)


GRID_WORLDS = (1, 2, 4, 8)


def predicted_only(brigade, flags):
    """The predicted peak in bytes, from the refusal of a budget every run exceeds."""
    r = subprocess.run([brigade, "train"] + flags + ["--steps", "1", "--memory-budget", "0.001"],
                       capture_output=True, text=True)
    m = re.search(r"predicted to hold ([0-9.]+) MiB", r.stderr)
    if r.returncode == 0 or not m:
        raise RuntimeError(f"no predicted peak in: {r.stderr.strip()[-300:]}")
    return float(m.group(1)) * (1 << 20)


def memory_grid(a, brigade):
    """The predicted against the measured whole-run peak over the grid (see the docstring)."""
    earlier = None
    if a.reuse:
        with open(a.reuse) as f:
            earlier = {(r["model"], r["world"], r["zero"], r["checkpointing"]): r for r in json.load(f)["rows"]}
    rows = []
    for model in ("mlp", "gpt"):
        for ck in ((0, 1) if model == "gpt" else (0,)):
            for world in GRID_WORLDS:
                for zero in (0, 1, 2, 3):
                    flags = (SMOKE_MODELS if a.smoke else MODELS)[model] + [
                        "--world-size", str(world), "--zero", str(zero)]
                    if ck:
                        flags += ["--activation-checkpointing", str(ck)]
                    if earlier:
                        old = earlier[(model, world, zero, ck)]
                        row = dict(old, predicted=predicted_only(brigade, flags))
                    else:
                        js = json.loads(sh([brigade, "train"] + flags + ["--steps", "3", "--quiet", "--json"]))
                        m = js["memory"]
                        row = {"model": model, "world": world, "zero": zero, "checkpointing": ck,
                               "predicted": m["predicted_peak_bytes"], "measured": m["peak_bytes"],
                               "parts": m.get("peak_parts")}
                    row["error"] = row["predicted"] / row["measured"] - 1
                    print(f"{model} w{world} zero{zero} ac{ck}: predicted {mib(row['predicted'])} MiB, measured "
                          f"{mib(row['measured'])} ({row['error'] * 100:+.1f}%)", file=sys.stderr, flush=True)
                    rows.append(row)
    return rows


def grid_order(rows):
    """The stages ordered at the measured peak as ZeRO promises (ZeRO-2 <= ZeRO-1 <= plain DDP):
    each setting of the grid where they are not."""
    measured = {(r["model"], r["checkpointing"], r["world"], r["zero"]): r["measured"] for r in rows}
    out = []
    for (model, ck, world, zero), plain in sorted(measured.items()):
        z1, z2 = measured.get((model, ck, world, 1)), measured.get((model, ck, world, 2))
        if zero != 0 or z1 is None or z2 is None:
            continue
        if z2 > z1:
            out.append(f"{model} checkpointing {ck} world {world}: ZeRO-2 {mib(z2)} > ZeRO-1 {mib(z1)} MiB")
        if z1 > plain:
            out.append(f"{model} checkpointing {ck} world {world}: ZeRO-1 {mib(z1)} > plain DDP {mib(plain)} MiB")
    settings = len({k[:3] for k in measured})
    head = f"ZeRO-2 <= ZeRO-1 <= plain DDP at the measured peak: {settings - len({o.split(':')[0] for o in out})} of {settings} settings"
    return "\n".join([head + (":" if out else ".")] + [f"- {o}" for o in out])


def grid_table(rows):
    lines = ["| model | checkpointing | world | zero 0 | zero 1 | zero 2 | zero 3 |", "|---|---|---|---|---|---|---|"]
    for model in ("mlp", "gpt"):
        for ck in (0, 1):
            for world in GRID_WORLDS:
                cells = {r["zero"]: r for r in rows if (r["model"], r["checkpointing"], r["world"]) == (model, ck, world)}
                if cells:
                    lines.append(f"| {model} | {'every block' if ck else 'off'} | {world} | " + " | ".join(
                        f"{mib(cells[z]['predicted'])} / {mib(cells[z]['measured'])} ({cells[z]['error'] * 100:+.1f}%)"
                        for z in sorted(cells)) + " |")
    lines += ["", grid_order(rows), ""]
    worst = max(rows, key=lambda r: abs(r["error"]))
    lines.append(f"\nPredicted / measured MiB per rank (error). Worst: {worst['model']} world {worst['world']} zero "
                 f"{worst['zero']} checkpointing {worst['checkpointing']}: {worst['error'] * 100:+.1f}%; "
                 f"{sum(abs(r['error']) < 0.10 for r in rows)} of {len(rows)} within 10%.")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/plan-validation")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--confirm", type=int, default=5,
                    help="head-to-head runs of the pick and the best measured, each")
    ap.add_argument("--settings", default="mlp-w2,gpt-w2,mlp-w4")
    ap.add_argument("--gbps", default="1,10")
    ap.add_argument("--brigade", default=None)
    ap.add_argument("--mpi-brigade", default=None)
    ap.add_argument("--no-mpi", action="store_true", help="leave out the MPI row")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--memory-grid", action="store_true", help="only the memory model over the grid")
    ap.add_argument("--reuse", default=None, help="with --memory-grid: measured peaks from this memory-grid.json")
    a = ap.parse_args()
    if a.smoke:
        a.repeat, a.steps, a.warmup, a.confirm = 1, 3, 1, 1
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    brigade = a.brigade
    if brigade is None:
        sh(["cargo", "build", "--release", "-q", "-p", "brigade-cli"])
        brigade = "target/release/brigade"
    os.makedirs(a.out, exist_ok=True)
    if a.memory_grid:
        rows = memory_grid(a, brigade)
        with open(os.path.join(a.out, "memory-grid.json"), "w") as f:
            json.dump({"load_average": os.getloadavg(), "rows": rows}, f, indent=1)
        print(grid_table(rows))
        return
    start = time.time()
    load = os.getloadavg()
    results = []
    for s in a.settings.split(","):
        model, world = s.split("-w")
        for g in a.gbps.split(","):
            results.append(setting(a, brigade, a.out, model, int(world), float(g) if "." in g else int(g)))
    mpi = a.mpi_brigade
    if mpi is None and shutil.which("mpirun") and not (a.smoke or a.no_mpi):
        sh(["cargo", "build", "--release", "-q", "-p", "brigade-cli", "--features", "mpi",
            "--target-dir", "target/mpi"])
        mpi = "target/mpi/release/brigade"
    if mpi and not a.no_mpi:
        launcher = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]
        results.append(setting(a, mpi, a.out, "mlp", 2, None, launcher, ["--backend", "mpi"]))
    report = {"load_average_before": load, "load_average_after": os.getloadavg(),
              "seconds": time.time() - start, "repeat": a.repeat, "steps": a.steps, "warmup": a.warmup,
              "confirm": a.confirm,
              "results": results}
    with open(os.path.join(a.out, "plan-validation.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}; {time.time() - start:.0f} s")
    print(table(results))


if __name__ == "__main__":
    main()
