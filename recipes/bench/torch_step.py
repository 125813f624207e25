"""The copus benchmark step in PyTorch eager, for a same-run comparison.

Same shape and work as `recipes bench`: Llama-style decoder (RMSNorm, rotate-half RoPE,
grouped-query attention, SwiGLU), untied head, fp32, AdamW; by default d_model 256, 4 layers,
8 heads, 4 kv heads, ffn 688, vocab 4096, sequence 256, micro-batch 8 (`--shape` sets
d,layers,heads,kv_heads,ffn,vocab,seq,batch).

What a user would run instead, in variants: `--device cuda`, `--dtype bf16` (autocast to bf16,
f32 master weights and AdamW state), `--attention sdpa` (scaled_dot_product_attention, its flash
or memory-efficient kernel on CUDA, where `manual` is the masked softmax written out),
`--fused-adamw` (one kernel per parameter group where the device has it), `--compile`
(torch.compile of the forward and loss), `--accum N` micro-batches per step (the global batch
is N x the micro-batch). Every timer stops after a device synchronisation.

It serves the benchmark one request per line on stdin, so that the two sides can step in turn
and the machine's drift falls on both: it first prints `{"threads": n, "device": ...}`, then
answers `step` with the seconds of each phase of one training step (body and final norm
forward, head and loss forward, backward, optimizer; under `--compile` the forward and loss are
one phase, `body`) and its peak memory in bytes, allocated and reserved by the caching
allocator (CUDA; 0 on the CPU), `count` with the operator
calls (`aten::` events of PyTorch's profiler, nested calls included) of one micro-batch's
forward, loss and backward, and `gemm mxkxn,...` with the GFLOP/s of each GEMM alone, each
answer one JSON line. It exits at the end of its input.
"""
import argparse, json, math, sys, time

import torch
import torch.nn as nn
import torch.nn.functional as F

D, L, H, KV, FF, V, S, B = 256, 4, 8, 4, 688, 4096, 256, 8
E = D // H


def set_shape(text):
    global D, L, H, KV, FF, V, S, B, E
    D, L, H, KV, FF, V, S, B = (int(x) for x in text.split(","))
    E = D // H


ATTENTION = "manual"


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(s, e, theta=10000.0):
    inv = theta ** (-torch.arange(0, e, 2).float() / e)
    ang = torch.arange(s).float()[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def rope(x, cos, sin):
    x1, x2 = x[..., : E // 2], x[..., E // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(D), RMSNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False), nn.Linear(D, KV * E, bias=False),
                                          nn.Linear(D, KV * E, bias=False), nn.Linear(D, D, bias=False))
        self.gate, self.up, self.down = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False), nn.Linear(FF, D, bias=False)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = rope(self.q(h).view(b, s, H, E).transpose(1, 2), cos, sin)
        k = rope(self.k(h).view(b, s, KV, E).transpose(1, 2), cos, sin)
        v = self.v(h).view(b, s, KV, E).transpose(1, 2)
        if ATTENTION == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(E), enable_gqa=H != KV)
        else:
            k = k.repeat_interleave(H // KV, dim=1)
            v = v.repeat_interleave(H // KV, dim=1)
            att = (q @ k.transpose(2, 3)) / math.sqrt(E)
            att = att.masked_fill(mask, float("-inf")).softmax(-1)
            y = att @ v
        x = x + self.o(y.transpose(1, 2).reshape(b, s, D))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Layer() for _ in range(L))
        self.norm = RMSNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def body(self, ids, cos, sin, mask):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)

    def head_logits(self, x):
        return self.head(x)


def gemm_gflops(spec, device):
    out = []
    for mkn in filter(None, spec.split(",")):
        m, k, n = (int(x) for x in mkn.split("x"))
        a_, b_ = torch.rand(m, k, device=device), torch.rand(k, n, device=device)
        (a_ @ b_)[:1, :1].sum().item()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            (a_ @ b_)[:1, :1].sum().item()
            times.append(time.perf_counter() - t)
        out.append(2 * m * k * n / sorted(times)[len(times) // 2] / 1e9)
    return out


def main():
    global ATTENTION
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shape", type=str, default="")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--attention", choices=["manual", "sdpa"], default="manual")
    p.add_argument("--fused-adamw", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--accum", type=int, default=1)
    a = p.parse_args()
    if a.shape:
        set_shape(a.shape)
    ATTENTION = a.attention
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    model = Model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            **({"fused": True} if a.fused_adamw else {}))
    cos, sin = (t.to(device) for t in rope_tables(S, E))
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device=device), 1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def body(ids):
        with autocast:
            return model.body(ids, cos, sin, mask)

    def head_loss(x, tgt):
        with autocast:
            return F.cross_entropy(model.head_logits(x).view(-1, V).float(), tgt.view(-1))

    def whole(ids, tgt):
        return head_loss(body(ids), tgt)

    compiled = torch.compile(whole) if a.compile else None
    rng = torch.Generator().manual_seed(1)

    def batch():
        ids = torch.randint(0, V, (B, S), generator=rng).to(device, non_blocking=True)
        tgt = torch.randint(0, V, (B, S), generator=rng).to(device, non_blocking=True)
        return ids, tgt

    def step():
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        phases = {"body": 0.0, "head_loss": 0.0, "backward": 0.0}
        for _ in range(a.accum):
            ids, tgt = batch()
            sync()
            t0 = time.perf_counter()
            if compiled is not None:
                loss = compiled(ids, tgt)
                loss.item()
                t2 = t1 = time.perf_counter()
            else:
                x = body(ids)
                sync()
                t1 = time.perf_counter()
                loss = head_loss(x, tgt)
                loss.item()
                t2 = time.perf_counter()
            (loss / a.accum).backward()
            sync()
            t3 = time.perf_counter()
            phases["body"] += t1 - t0
            phases["head_loss"] += t2 - t1
            phases["backward"] += t3 - t2
        t3 = time.perf_counter()
        opt.step()
        sync()
        phases["optimizer"] = time.perf_counter() - t3
        phases["peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else 0
        phases["peak_reserved_bytes"] = torch.cuda.max_memory_reserved() if cuda else 0
        return phases

    def count():
        ids, tgt = batch()
        opt.zero_grad(set_to_none=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            (compiled or whole)(ids, tgt).backward()
            sync()
        return {"aten_calls": sum(1 for e in prof.events() if e.name.startswith("aten::"))}

    def answer(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"threads": torch.get_num_threads(), "device": str(device)})
    for line in sys.stdin:
        words = line.split()
        if words == ["step"]:
            answer(step())
        elif words == ["count"]:
            answer(count())
        elif words[:1] == ["gemm"]:
            answer({"gemm_gflops": gemm_gflops(words[1] if len(words) > 1 else "", device)})
        elif words:
            answer({"error": "unknown request " + line.strip()})


if __name__ == "__main__":
    main()
