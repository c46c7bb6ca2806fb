#!/usr/bin/env python3
"""PyTorch's side of `brigade bench ops`: where one training step's time goes, per op kind,
forward and backward, on the torchref workloads (CPU, one thread by default).

    <torchref venv>/bin/python scripts/torch_ops_profile.py --workload gpt [--threads 1]
        [--steps 10] [--warmup 3] [--torchref ../shared/torchref] [--precision f32|bf16|fp16]

Prints (1) the plain step split (forward / backward / optimizer, no profiler, medians),
(2) a table in Brigade's op kinds (`linear`, `layer_norm`, `attention`, `gelu`, `add`,
`embedding`, `cross_entropy`, views, `accumulate_grad`) built from torch.profiler events:
forward = the CPU total of each top-level aten op under the forward, backward = the CPU total
of each autograd node (`autograd::engine::evaluate_function: XBackward0`), and (3) the raw
per-name rows behind it. The profiler adds overhead to every op; compare shares and the
plain split, not the profiled milliseconds, with Brigade's table. `--precision bf16` (or fp16)
runs the forward under `torch.autocast("cpu", dtype)`, the f32 parameters and optimizer as
they are: PyTorch's mixed-precision recipe, beside `brigade bench ops --precision bf16`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

FORWARD_KIND = {
    "aten::linear": "linear",
    "aten::layer_norm": "layer_norm",
    "aten::scaled_dot_product_attention": "attention",
    "aten::gelu": "gelu",
    "aten::relu": "relu",
    "aten::add": "add",
    "aten::embedding": "embedding",
    "aten::cross_entropy_loss": "cross_entropy",
}

BACKWARD_KIND = [  # (substring of the autograd node name, Brigade's kind); first match wins
    ("Addmm", "linear"), ("Mm", "linear"), ("Bmm", "linear"), ("TBackward", "linear"),
    ("NativeLayerNorm", "layer_norm"), ("Attention", "attention"), ("Gelu", "gelu"),
    ("Relu", "relu"), ("Threshold", "relu"), ("AddBackward", "add"), ("Embedding", "embedding"),
    ("NllLoss", "cross_entropy"), ("LogSoftmax", "cross_entropy"), ("AccumulateGrad", "accumulate_grad"),
    ("View", "views"), ("Transpose", "views"), ("Split", "views"), ("Reshape", "views"),
    ("Slice", "views"), ("Select", "views"), ("Unsafe", "views"),
]


def backward_kind(name: str) -> str:
    for sub, kind in BACKWARD_KIND:
        if sub in name:
            return kind
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("gpt", "mlp"), default="gpt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--precision", choices=("f32", "bf16", "fp16"), default="f32")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--torchref", default=os.path.join(here, "..", "..", "shared", "torchref"))
    a = ap.parse_args()
    if a.steps < 1 or a.threads < 1:
        print("error: --steps and --threads must be at least 1", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.abspath(a.torchref))
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function
        import workloads
    except ImportError as e:
        print(f"error: {e} (run with the torchref venv's python; --torchref points at workloads.py)",
              file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    wl = workloads.get_workload(a.workload)
    model = wl.build_model(0)
    opt = wl.make_optimizer(model)
    (batch,) = [wl.make_batches(0, 1)[0]]
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)

    def forward():
        if autocast is None:
            return wl.loss(model, batch)
        with torch.autocast("cpu", dtype=autocast):
            return wl.loss(model, batch)

    def step(timed):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with record_function("## forward"):
            loss = forward()
        t1 = time.perf_counter()
        with record_function("## backward"):
            loss.backward()
        t2 = time.perf_counter()
        with record_function("## optimizer"):
            opt.step()
        t3 = time.perf_counter()
        timed.append((t1 - t0, t2 - t1, t3 - t2))

    plain = []
    for _ in range(a.warmup):
        step([])
    for _ in range(a.steps):
        step(plain)
    med = [statistics.median(x[i] for x in plain) * 1e3 for i in range(3)]
    total = statistics.median(sum(x) for x in plain) * 1e3
    print(f"PyTorch {torch.__version__}, {a.workload}, {a.precision}, {a.threads} thread(s), median of {a.steps} steps "
          f"without the profiler: forward {med[0]:.3f} ms, backward {med[1]:.3f} ms, "
          f"optimizer {med[2]:.3f} ms, step {total:.3f} ms")

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            step([])
    fwd, bwd = defaultdict(float), defaultdict(float)
    fwd_calls, bwd_calls = defaultdict(int), defaultdict(int)
    raw_f, raw_b = defaultdict(float), defaultdict(float)
    labels = {"## forward": 0.0, "## backward": 0.0, "## optimizer": 0.0}
    for ev in prof.events():
        name, us = ev.name, ev.cpu_time_total
        if name in labels:
            labels[name] += us
            continue
        parent = ev.cpu_parent
        if parent is not None and parent.name == "## forward":
            kind = FORWARD_KIND.get(name, "other")
            fwd[kind] += us
            fwd_calls[kind] += 1
            raw_f[name] += us
        elif name.startswith("autograd::engine::evaluate_function:"):
            node = name.split(":", 3)[-1].strip()
            kind = backward_kind(node)
            bwd[kind] += us
            bwd_calls[kind] += 1
            raw_b[node] += us
    n = a.steps
    prof_total = sum(labels.values())
    print(f"\nper op kind under torch.profiler (ms per step; profiled step {prof_total / 1e3 / n:.3f} ms)")
    print(f"{'op':<22} {'fwd ms':>10} {'calls':>8} {'bwd ms':>10} {'calls':>8} {'share':>7}")
    kinds = sorted(set(fwd) | set(bwd), key=lambda k: -(fwd[k] + bwd[k]))
    for k in kinds:
        print(f"{k:<22} {fwd[k] / 1e3 / n:>10.3f} {fwd_calls[k] / n:>8.1f} {bwd[k] / 1e3 / n:>10.3f} "
              f"{bwd_calls[k] / n:>8.1f} {100 * (fwd[k] + bwd[k]) / prof_total:>6.1f}%")
    print(f"{'optimizer step':<22} {'':>10} {'':>8} {labels['## optimizer'] / 1e3 / n:>10.3f} {'':>8} "
          f"{100 * labels['## optimizer'] / prof_total:>6.1f}%")
    print(f"{'forward / backward':<22} {labels['## forward'] / 1e3 / n:>10.3f} {'':>8} "
          f"{labels['## backward'] / 1e3 / n:>10.3f}")
    print("\nraw forward ops (ms per step):")
    for name, us in sorted(raw_f.items(), key=lambda x: -x[1]):
        print(f"  {name:<50} {us / 1e3 / n:>9.3f}")
    print("raw backward nodes (ms per step):")
    for name, us in sorted(raw_b.items(), key=lambda x: -x[1]):
        print(f"  {name:<50} {us / 1e3 / n:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
