#!/usr/bin/env python3
"""Brigade's GPT under --precision f32|bf16|fp16 against PyTorch's autocast on the same
initial weights and the same rows, one rank, one loss curve each.

PyTorch's side: f32; `torch.autocast("cpu", dtype=torch.bfloat16)` with the parameters and
AdamW in f32 (autocast's master weights); `torch.autocast("cpu", dtype=torch.float16)` with
`torch.amp.GradScaler("cpu")` (its defaults: 2^16, x2 after 2000 clean steps, x0.5 and a
skipped step on inf/NaN). Brigade's side: `brigade train --init` on the weights PyTorch drew,
`--text` on the same file. The rows are Brigade's for `--text` without `--shuffle`: the file's
bytes less its last tenth, windows of context + 1 every context / 2, in order.

The f32 pair checks that both sides run the same model on the same rows (their curves agree to
float rounding); the 16-bit pairs are the comparison.

    python3 scripts/precision-vs-pytorch.py --brigade target/release/brigade \
        --python ~/torchref/.venv/bin/python --torchref ../shared/torchref --out /tmp/pvt

(`--python` is the interpreter that has torch and safetensors; the script re-runs itself under
it for PyTorch's part.)
"""
import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time


def model_flags(a):
    return ["--model", "gpt", "--d-model", str(a.d_model), "--layers", str(a.layers), "--heads",
            str(a.heads), "--d-ff", str(a.d_ff), "--context", str(a.context)]


def rows_of(text_path, context):
    data = open(text_path, "rb").read()
    n = len(data)
    at = n - min(math.ceil(n * 0.1), n)
    while at < n and (data[at] & 0xC0) == 0x80:
        at += 1
    train, row, stride = data[:at], context + 1, max(context // 2, 1)
    count = (len(train) - row) // stride + 1
    return [train[i * stride:i * stride + row] for i in range(count)]


def torch_run(a, precision):
    """PyTorch's loss curve (and skipped steps) under f32 or autocast; runs under --python."""
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, a.torchref)
    from workloads import GPT
    torch.set_num_threads(2)
    torch.manual_seed(a.seed)
    model = GPT(vocab=256, d=a.d_model, n_layers=a.layers, n_heads=a.heads, d_ff=a.d_ff, ctx=a.context)
    from safetensors.torch import load_file
    model.load_state_dict(load_file(a.init), strict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01, foreach=False)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    rows = rows_of(a.text, a.context)
    losses, skipped, t0 = [], 0, time.time()
    for step in range(a.steps):
        batch = torch.tensor([list(rows[(step * a.batch_size + j) % len(rows)])
                              for j in range(a.batch_size)], dtype=torch.int64)
        x, y = batch[:, :-1], batch[:, 1:]
        if dtype is None:
            logits = model(x)
        else:
            with torch.autocast("cpu", dtype=dtype):
                logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < scale
        losses.append(loss.item())
    return {"losses": losses, "skipped": int(skipped), "seconds": time.time() - t0}


def brigade_run(a, precision, out):
    losses = os.path.join(out, f"brigade-{precision}.csv")
    cmd = [a.brigade, "train", *model_flags(a), "--init", a.init, "--text", a.text,
           "--batch-size", str(a.batch_size), "--steps", str(a.steps), "--lr", str(a.lr),
           "--optimizer", "adamw", "--weight-decay", "0.01", "--precision", precision,
           "--losses", losses]
    t0 = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    seconds = time.time() - t0
    with open(losses) as f:
        rows = list(csv.DictReader(f))
    skipped = sum(1 for i in range(1, len(rows)) if float(rows[i]["scale"]) < float(rows[i - 1]["scale"])) \
        if rows and "scale" in rows[0] else 0
    return {"losses": [float(r["loss"]) for r in rows], "skipped": skipped, "seconds": seconds,
            "command": " ".join(cmd)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--brigade", default="target/release/brigade")
    p.add_argument("--python", default=sys.executable, help="an interpreter with torch and safetensors")
    p.add_argument("--torchref", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "torchref"))
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--out", default="precision-vs-pytorch")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-part", help=argparse.SUPPRESS)  # internal: PyTorch's run of one precision
    p.add_argument("--init", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.torchref = os.path.abspath(a.torchref)
    if a.torch_part:
        if a.torch_part == "init":
            import torch
            sys.path.insert(0, a.torchref)
            from workloads import GPT
            from safetensors.torch import save_file
            torch.manual_seed(a.seed)
            m = GPT(vocab=256, d=a.d_model, n_layers=a.layers, n_heads=a.heads, d_ff=a.d_ff, ctx=a.context)
            save_file({k: v.detach().float().contiguous().clone() for k, v in m.state_dict().items()}, a.init)
        else:
            print(json.dumps(torch_run(a, a.torch_part)))
        return
    os.makedirs(a.out, exist_ok=True)
    a.init = os.path.join(a.out, "init.safetensors")
    me = [a.python, os.path.abspath(__file__), "--torchref", a.torchref, "--text", a.text, "--init", a.init,
          "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--lr", str(a.lr), "--d-model",
          str(a.d_model), "--layers", str(a.layers), "--heads", str(a.heads), "--d-ff", str(a.d_ff),
          "--context", str(a.context), "--seed", str(a.seed)]
    subprocess.run(me + ["--torch-part", "init"], check=True)
    results = {}
    for precision in ("f32", "bf16", "fp16"):
        torch_out = subprocess.run(me + ["--torch-part", precision], check=True, capture_output=True, text=True)
        results[precision] = {"pytorch": json.loads(torch_out.stdout.strip().splitlines()[-1]),
                              "brigade": brigade_run(a, precision, a.out)}
    json.dump(results, open(os.path.join(a.out, "precision-vs-pytorch.json"), "w"), indent=1)

    f32 = results["f32"]
    worst = max(abs(b - t) / abs(t) for b, t in zip(f32["brigade"]["losses"], f32["pytorch"]["losses"]))
    print(f"f32, Brigade against PyTorch, the largest relative difference over {a.steps} steps: {worst:.2e}")
    print()
    print("| precision | PyTorch final loss | Brigade final loss | Brigade vs PyTorch | Brigade vs its f32 | skipped steps (PyTorch / Brigade) | seconds (PyTorch / Brigade) |")
    print("|---|---|---|---|---|---|---|")
    b32 = f32["brigade"]["losses"][-1]
    for precision, r in results.items():
        t, b = r["pytorch"]["losses"][-1], r["brigade"]["losses"][-1]
        print(f"| {precision} | {t:.4f} | {b:.4f} | {(b - t) / t:+.2%} | {(b - b32) / b32:+.2%} | "
              f"{r['pytorch']['skipped']} / {r['brigade']['skipped']} | "
              f"{r['pytorch']['seconds']:.1f} / {r['brigade']['seconds']:.1f} |")
    print()
    print("Brigade's commands:")
    for precision, r in results.items():
        print(f"  {r['brigade']['command']}")


if __name__ == "__main__":
    main()
