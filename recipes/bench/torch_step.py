"""The copus benchmark step in PyTorch eager, for a same-run comparison.

Same shape and work as `recipes bench`: Llama-style decoder (RMSNorm, rotate-half RoPE,
grouped-query attention, SwiGLU), untied head, fp32, AdamW; by default d_model 256, 4 layers,
8 heads, 4 kv heads, ffn 688, vocab 4096, sequence 256, micro-batch 8 (`--shape` sets
d,layers,heads,kv_heads,ffn,vocab,seq,batch).

It serves the benchmark one request per line on stdin, so that the two sides can step in turn
and the machine's drift falls on both: it first prints `{"threads": n}`, then answers `step`
with the seconds of each phase of one training step (body and final norm forward, head and
loss forward, backward, optimizer) and `gemm mxkxn,...` with the GFLOP/s of each GEMM alone,
each answer one JSON line. It exits at the end of its input.
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
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
        att = (q @ k.transpose(2, 3)) / math.sqrt(E)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, s, D))
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


def gemm_gflops(spec):
    out = []
    for mkn in filter(None, spec.split(",")):
        m, k, n = (int(x) for x in mkn.split("x"))
        a_, b_ = torch.rand(m, k), torch.rand(k, n)
        (a_ @ b_)[:1, :1].sum().item()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            (a_ @ b_)[:1, :1].sum().item()
            times.append(time.perf_counter() - t)
        out.append(2 * m * k * n / sorted(times)[len(times) // 2] / 1e9)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shape", type=str, default="")
    a = p.parse_args()
    if a.shape:
        set_shape(a.shape)
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    cos, sin = rope_tables(S, E)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)

    def step():
        ids = torch.randint(0, V, (B, S))
        tgt = torch.randint(0, V, (B, S))
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        x = model.body(ids, cos, sin, mask)
        t1 = time.perf_counter()
        loss = F.cross_entropy(model.head_logits(x).view(-1, V), tgt.view(-1))
        loss.item()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        return {"body": t1 - t0, "head_loss": t2 - t1, "backward": t3 - t2, "optimizer": t4 - t3}

    def answer(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"threads": torch.get_num_threads()})
    for line in sys.stdin:
        words = line.split()
        if words == ["step"]:
            answer(step())
        elif words[:1] == ["gemm"]:
            answer({"gemm_gflops": gemm_gflops(words[1] if len(words) > 1 else "")})
        elif words:
            answer({"error": "unknown request " + line.strip()})


if __name__ == "__main__":
    main()
