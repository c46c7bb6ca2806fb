# What crates/brigade/examples/pytorch_parity.rs does, in PyTorch: an 8->64->LayerNorm->GELU->1
# regressor on synthetic data, 2 ranks, AdamW, an int8 comm hook with error feedback, warmup +
# cosine, clipping at 1.0, a checkpoint at step 25 of 50 and an exact resume from it (asserted),
# held-out evaluation in eval mode. Run: torchrun --nproc_per_node 2 scripts/pytorch_parity.py
import math, os, tempfile, torch, torch.distributed as dist, torch.nn as nn

def data(rows, seed):
    x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed))
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7)) * 0.5
    noise = torch.randn(rows, 1, generator=torch.Generator().manual_seed(seed + 1)) * 0.05
    return x, torch.sin(x @ w) + noise

def int8_hook(state, bucket):  # state: the residual of each parameter, by name, across steps
    names, ps = state["names"], bucket.parameters()
    g = bucket.buffer() + torch.cat([state.get(names[p], torch.zeros(p.numel())) for p in ps])
    scale = (g.abs().max().clamp(min=1e-30) / 127).reshape(1)
    q = (g / scale).round().clamp(-127, 127).to(torch.int8)
    state.update(zip([names[p] for p in ps], (g - q.float() * scale).split([p.numel() for p in ps])))
    qs, ss = [torch.empty_like(q) for _ in range(2)], [torch.empty_like(scale) for _ in range(2)]
    dist.all_gather(qs, q), dist.all_gather(ss, scale)
    out = sum(qi.float() * si for qi, si in zip(qs, ss)) / dist.get_world_size()
    fut = torch.futures.Future(); fut.set_result(out); return fut

def run(ckpt, resume):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 1))
    ddp, hook_state = nn.parallel.DistributedDataParallel(model), {"names": {p: n for n, p in model.named_parameters()}}
    ddp.register_comm_hook(hook_state, int8_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.01)
    lr = lambda s: (s + 1) / 5 if s < 5 else 0.5 * (1 + math.cos(math.pi * (s - 5) / 45))
    sched, start, losses, val = torch.optim.lr_scheduler.LambdaLR(opt, lr), 0, [], []
    if resume:
        c = torch.load(ckpt, weights_only=False)
        model.load_state_dict(c["model"]), opt.load_state_dict(c["opt"]), sched.load_state_dict(c["sched"])
        hook_state.update(c["hook"][dist.get_rank()]); start = c["step"]
    (x, y), (vx, vy), rank = data(4096, 1), data(512, 100), dist.get_rank()
    for step in range(start, 50):
        if step == 25 and not resume:
            hooks = [None, None]; dist.all_gather_object(hooks, {k: v for k, v in hook_state.items() if k != "names"})
            if rank == 0:
                torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), sched=sched.state_dict(),
                                hook=hooks, step=25), ckpt)
        i = (step * 2 + rank) * 32 % 4096
        loss = nn.functional.mse_loss(ddp(x[i:i + 32]), y[i:i + 32])
        opt.zero_grad(); loss.backward()
        nn.utils.clip_grad_norm_(ddp.parameters(), 1.0); opt.step(); sched.step()
        dist.all_reduce(l := loss.detach().clone()); losses.append(l.item() / 2)
        if (step + 1) % 25 == 0:
            model.eval()
            with torch.no_grad(): val.append(nn.functional.mse_loss(model(vx), vy).item())
            model.train()
    return losses, val, [p.detach().clone() for p in model.parameters()]

dist.init_process_group("gloo")
ckpt = os.path.join(tempfile.gettempdir(), "pytorch_parity.pt")
straight, val, params = run(ckpt, False)
dist.barrier()
resumed, _, resumed_params = run(ckpt, True)
assert resumed == straight[25:] and all(torch.equal(a, b) for a, b in zip(params, resumed_params)), "exact resume"
if dist.get_rank() == 0: print(f"held-out loss (eval mode) after steps 25 and 50: {val}; resume exact")
dist.destroy_process_group()
