#!/usr/bin/env python3
"""The comparisons of scripts/gpu-check.sh, in one place, so that they are tested on made-up
inputs here (scripts/test_gpu_check.py) and on the GPU machine itself before they judge a run.

Standard library only (the GPU machine has python3; this file must not need anything else).

Every comparison prints one line "STATUS NAME: what was measured" and exits with
0 (PASS), 1 (FAIL: something is wrong) or 2 (MISS: correct, but a speed goal was not reached).

    gpu_check.py env                                  environment lines (driver, CUDA, NCCL, torch, glibc)
    gpu_check.py glibc BINARY...                      the newest GLIBC_x.y each binary needs
    gpu_check.py losses NAME A.csv B.csv TOL          loss curves (step,loss) agree within TOL (relative)
    gpu_check.py overlap NAME TRACE.json              bucket collectives interleave with backward spans
    gpu_check.py predict NAME TRAIN.log PREDICT.json  measured step vs `brigade predict` on its profile
    gpu_check.py zero3 NAME TRAIN.log                 a ZeRO-3 run's `--json` memory: units gathered (peak
                                                      above 0) and freed (below the parameters' bytes)
    gpu_check.py gemm NAME BENCH.json GOAL            outputs equal cuBLAS's; speed >= GOAL x cuBLAS
    gpu_check.py step NAME TRAIN.log TORCH.json GOAL [KEY]  Brigade's step <= GOAL x PyTorch's (KEY:
                                                      torch_gpt_step_bf16 for autocast's)
"""

import csv
import json
import os
import re
import struct
import subprocess
import sys

PASS, FAIL, MISS = 0, 1, 2
WORD = {PASS: "PASS", FAIL: "FAIL", MISS: "MISS"}


def load_json(path):
    with open(path) as f:
        return json.load(f)


def read_text(path):
    with open(path) as f:
        return f.read()


def verdict(status, name, text):
    """The summary line and the exit status."""
    print(f"{WORD[status]} {name}: {text}")
    return status


# ---------------------------------------------------------------- losses


def read_losses(path):
    """Losses of a `brigade train --losses` CSV (header step,loss), in step order."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "loss" not in rows[0] or "step" not in rows[0]:
        raise ValueError(f"{path}: not a step,loss CSV")
    return [(int(r["step"]), float(r["loss"])) for r in rows]


def compare_losses(name, a_path, b_path, tol):
    """A's losses against the reference B's: same steps, worst relative difference <= tol."""
    try:
        a, b = read_losses(a_path), read_losses(b_path)
    except (OSError, ValueError) as e:
        return verdict(FAIL, name, f"cannot read the losses: {e}")
    if [s for s, _ in a] != [s for s, _ in b] or not a:
        return verdict(FAIL, name, f"the runs have different steps ({len(a)} vs {len(b)} rows)")
    worst, at = 0.0, a[0][0]
    for (step, x), (_, y) in zip(a, b):
        d = abs(x - y) / max(abs(y), 1e-12)
        if d != d or d > worst:  # NaN is the worst
            worst, at = d, step
            if d != d:
                break
    ok = worst <= tol
    return verdict(
        PASS if ok else FAIL,
        name,
        f"worst relative loss difference {worst:.2e} at step {at} (tolerance {tol:g}) over {len(a)} steps; "
        f"last loss {a[-1][1]:.6f} vs {b[-1][1]:.6f}",
    )


# ---------------------------------------------------------------- overlap


def spans(trace, rank=0):
    """(bucket collective spans, backward spans) of one rank, as (start_us, end_us, label)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    buckets, backward = [], []
    for e in events:
        if e.get("ph") != "X" or e.get("pid") != rank:
            continue
        args = e.get("args", {})
        kind = args.get("kind")
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        if e.get("cat") == "comm" and args.get("op") == "all_reduce":
            if isinstance(kind, dict) and isinstance(kind.get("Collective"), dict):
                if kind["Collective"].get("bucket") is not None:
                    buckets.append((start, end, args.get("tag", e.get("name"))))
        elif e.get("cat") == "compute" and isinstance(kind, dict) and "Backward" in kind:
            backward.append((start, end, e.get("name")))
    return buckets, backward


def overlap_us(a, b):
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def check_overlap(name, trace_path, rank=0):
    """Fails unless some bucket's collective runs while backward still runs: the first bucket
    starts before the last backward span ends, and bucket time intersects backward spans."""
    try:
        trace = load_json(trace_path)
    except (OSError, ValueError) as e:
        return verdict(FAIL, name, f"cannot read the trace: {e}")
    buckets, backward = spans(trace, rank)
    if not buckets or not backward:
        return verdict(FAIL, name, f"{len(buckets)} bucket collectives and {len(backward)} backward spans in the trace")
    last_backward_end = max(e for _, e, _ in backward)
    first_bucket_start = min(s for s, _, _ in buckets)
    hidden = [sum(overlap_us(bk, bw) for bw in backward) for bk in buckets]
    overlapping = sum(1 for h in hidden if h > 0)
    total = sum(e - s for s, e, _ in buckets)
    ok = overlapping > 0 and first_bucket_start < last_backward_end
    return verdict(
        PASS if ok else FAIL,
        name,
        f"{overlapping} of {len(buckets)} bucket collectives overlap backward spans; {sum(hidden):.0f} of "
        f"{total:.0f} us of bucket time runs beside backward; first bucket starts "
        f"{last_backward_end - first_bucket_start:.0f} us before backward ends",
    )


# ---------------------------------------------------------------- numbers


def json_from_log(path):
    """The last JSON object printed in a log (brigade train --json prints one)."""
    text = read_text(path)
    for m in reversed(list(re.finditer(r"^\{.*?^\}", text, re.S | re.M))):
        try:
            return json.loads(m.group(0))
        except ValueError:
            continue
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise ValueError(f"{path}: no JSON object")


def check_predict(name, train_log, predict_json, within=0.25):
    """The measured median step against `brigade predict`'s prediction on the same profile."""
    try:
        measured = float(json_from_log(train_log)["median_step_ms"])
        text = read_text(predict_json)
        rows = json.loads(text[text.index("["):text.rindex("]") + 1])
        predicted = float(rows[0]["predicted_step_s"]) * 1e3
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        return verdict(MISS, name, f"no prediction to compare: {e}")
    ratio = measured / predicted if predicted > 0 else float("inf")
    ok = abs(ratio - 1.0) <= within
    return verdict(
        PASS if ok else MISS,
        name,
        f"measured step {measured:.2f} ms, predicted {predicted:.2f} ms: ratio {ratio:.2f} (goal within {within:.0%})",
    )


def check_zero3(name, train_log):
    """ZeRO-3 gathered its units (the most bytes gathered at once is above 0) and freed them on
    the device (that most is below the parameters' bytes: never the whole model at once)."""
    try:
        memory = json_from_log(train_log)["memory"]
        gathered, params = int(memory["gathered_bytes"]), int(memory["parameter_bytes"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return verdict(FAIL, name, f"no ZeRO-3 memory line to read: {e}")
    ok = 0 < gathered < params
    return verdict(
        PASS if ok else FAIL,
        name,
        f"most parameters gathered at once {gathered} B against {params} B of parameters "
        f"({gathered / params if params else float('inf'):.2f}; goal above 0, below 1)",
    )


def check_gemm(name, bench_json, goal):
    """Each dtype's outputs must equal cuBLAS's (else FAIL); speed >= goal x cuBLAS (else MISS)."""
    try:
        rows = load_json(bench_json)
    except (OSError, ValueError) as e:
        return verdict(FAIL, name, f"cannot read the benchmark: {e}")
    if not rows:
        return verdict(FAIL, name, "the benchmark measured nothing")
    status, parts = PASS, []
    for r in rows:
        if not r.get("outputs_equal", False):
            status = FAIL
            parts.append(f"{r['dtype']}: output differs from cuBLAS's ({r.get('mismatches')} elements, worst "
                         f"{r.get('worst_abs_diff')} at {r.get('worst_index')})")
            continue
        ratio = float(r["ratio"])
        if ratio < goal and status == PASS:
            status = MISS
        parts.append(f"{r['dtype']} {ratio:.2f}x cuBLAS ({r.get('brigade_tflops')} vs {r.get('cublas_tflops')} TFLOP/s)")
    return verdict(status, name, "; ".join(parts) + f" (goal >= {goal}x, outputs equal)")


def check_step(name, train_log, torch_json, goal, key="torch_gpt_step"):
    """Brigade's median GPT step against PyTorch's on the same GPU (`key` of torch_json: eager
    f32, or torch_gpt_step_bf16 under autocast): PASS at <= goal x."""
    try:
        ms = float(json_from_log(train_log)["median_step_ms"])
    except (OSError, ValueError, KeyError) as e:
        return verdict(FAIL, name, f"Brigade's run gave no step time: {e}")
    try:
        t = load_json(torch_json)[key]
        torch_ms = float(t["s"]) * 1e3
    except (OSError, ValueError, KeyError, TypeError) as e:
        return verdict(MISS, name, f"Brigade {ms:.1f} ms; PyTorch's side gave no time: {e}")
    ratio = ms / torch_ms
    return verdict(
        PASS if ratio <= goal else MISS,
        name,
        f"Brigade {ms:.1f} ms, PyTorch {'eager' if key == 'torch_gpt_step' else key} {torch_ms:.1f} ms: "
        f"{ratio:.2f}x (goal <= {goal}x)",
    )


# ---------------------------------------------------------------- environment and binaries


def glibc_needed(path):
    """The newest GLIBC_x.y version an ELF binary asks for (its .gnu.version_r), or None."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path}: not a 64-bit ELF file")
    end = "<" if data[5] == 1 else ">"
    shoff, = struct.unpack_from(end + "Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from(end + "HHH", data, 0x3A)
    sections = []
    for i in range(shnum):
        off = shoff + i * shentsize
        name, typ, _flags, _addr, offset, size, link = struct.unpack_from(end + "IIQQQQI", data, off)
        sections.append((name, typ, offset, size, link))
    SHT_GNU_VERNEED = 0x6FFFFFFE
    best = None
    for _name, typ, offset, size, link in sections:
        if typ != SHT_GNU_VERNEED:
            continue
        strtab = sections[link]

        def string(o):
            start = strtab[2] + o
            return data[start:data.index(b"\0", start)].decode()

        at = offset
        while True:
            _ver, cnt, _file, aux, nxt = struct.unpack_from(end + "HHIII", data, at)
            a = at + aux
            for _ in range(cnt):
                _hash, _flags, _other, vname, anext = struct.unpack_from(end + "IHHII", data, a)
                v = string(vname)
                if v.startswith("GLIBC_") and re.fullmatch(r"GLIBC_\d+(\.\d+)*", v):
                    key = tuple(int(x) for x in v[6:].split("."))
                    if best is None or key > best:
                        best = key
                if anext == 0:
                    break
                a += anext
            if nxt == 0:
                break
            at += nxt
    return None if best is None else "GLIBC_" + ".".join(map(str, best))


def print_glibc(paths):
    status = PASS
    for p in paths:
        try:
            need = glibc_needed(p)
            print(f"{p}: needs {need or 'no versioned glibc symbol'}")
        except (OSError, ValueError) as e:
            print(f"{p}: {e}")
            status = FAIL
    return status


def run(cmd, timeout=20):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable ({e.__class__.__name__}: {e})"


def environment():
    """One line each: GPU and driver, CUDA, NCCL, PyTorch, glibc."""
    smi = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    print(f"env gpu: {smi.splitlines()[0] if smi else 'none'}")
    header = run(["nvidia-smi"])
    m = re.search(r"CUDA Version:\s*([\d.]+)", header)
    print(f"env cuda (driver): {m.group(1) if m else 'unknown'}")
    try:
        from importlib import metadata

        wheels = sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                        if (d.metadata["Name"] or "").lower().startswith(("nvidia-nccl", "nvidia-cublas",
                                                                          "nvidia-cuda-nvrtc", "torch")))
        print(f"env wheels: {', '.join(wheels) or 'none'}")
    except Exception as e:  # the check goes on without the list
        print(f"env wheels: unknown ({e})")
    torch = run([sys.executable, "-c", "import torch; print(torch.__version__, 'cuda', torch.version.cuda, "
                 "'available', torch.cuda.is_available())"], timeout=60)
    print(f"env torch: {torch.splitlines()[-1] if torch else 'none'}")
    libc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else "unknown"
    print(f"env glibc: {libc}")
    return PASS


def main(argv):
    if not argv:
        print(__doc__)
        return FAIL
    cmd, rest = argv[0], argv[1:]
    if cmd == "env":
        return environment()
    if cmd == "glibc":
        return print_glibc(rest)
    if cmd == "losses" and len(rest) == 4:
        return compare_losses(rest[0], rest[1], rest[2], float(rest[3]))
    if cmd == "overlap" and len(rest) == 2:
        return check_overlap(rest[0], rest[1])
    if cmd == "predict" and len(rest) == 3:
        return check_predict(rest[0], rest[1], rest[2])
    if cmd == "zero3" and len(rest) == 2:
        return check_zero3(rest[0], rest[1])
    if cmd == "gemm" and len(rest) == 3:
        return check_gemm(rest[0], rest[1], float(rest[2]))
    if cmd == "step" and len(rest) in (4, 5):
        return check_step(rest[0], rest[1], rest[2], float(rest[3]), *rest[4:])
    print(__doc__)
    return FAIL


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
