"""Does a per-row far scale lower a layer's fitted attention error?  A dense torch
prototype of one layer's attention transfer (512-token documents, window 16 + [CLS] +
[SEP] exact, Hedgehog maps m = 64 per head from the identity, g started at the median
exact / mapped far-mass ratio as ``linattn.transfer`` does, 150 Adam steps of 4 FIT
documents), relative attention-output error on the TEST documents for the map as the
library has it ("fitted") and with a learned linear shift of the log-features per query
("qscale": ``log phi(q) += q . a + c``), per key ("kscale": ``log phi(k) += k . a_k``),
both, or by the row's largest near logit ("rowmax": LoLCATs' form, whose near weights
are stabilised by their row maximum and its far weights not).  Two more measure what
limits the map rather than offering a path: "decay" damps the far weights by a learned
``exp(-r |t - j|)`` per head (what a scan could carry), and "same" attends exactly,
besides the window and sinks, to every key holding the query's own token (an oracle:
how much of the fitted map's error sits on repeated tokens), and "mass" gives each
row's far part the exact far mass (an oracle: what is left is the map's distribution
over the far keys).  Other forms of the map at the same m = 64: "free" (64 free
columns, ``softmax(x W + b)`` with ``W`` d x 64 from ``[I, -I]``: Hedgehog's map is its
special case), "split" (LoLCATs' halves, ``[softmax(x W), softmax(-x W)]``), "exp"
(Hedgehog's first form, ``exp([x W, -x W])``, not normalised), "rf" (positive random
features ``exp(x w - |x|^2 / 2)`` with learned directions) and "mlp" (``x W`` plus a
zero-started residual ReLU layer of width 128 before the softmax); "dir" gives the far keys
after the query (bidirectional attention) their own query map and far weight.  A
measurement, not a library path.

Each layer is fed the exact model's activations.  Printed per layer: the relative error
on the TEST documents (and on the FIT documents, ``_fit``), its ratio to window + sinks',
and per head the error and the head's share of the layer's output norm (a head with a
large share and a large error decides the layer's figure).

    python benchmarks/transfer_far_scale.py 0 150 fitted,qscale,kscale,both
    python benchmarks/transfer_far_scale.py 0 150 fitted,rowmax,decay,same,mass
    python benchmarks/transfer_far_scale.py 0 150 fitted,free,split,exp,rf,mlp
    python benchmarks/transfer_far_scale.py 0 150 fitted,dir
    python benchmarks/transfer_far_scale.py 1,2 150 fitted
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import documents

from linattn.models import load_model
from linattn.models.bert import exact_attention
from linattn.models.convert import length_batches, sep_mask

torch.set_num_threads(1)
layer_ids = [int(x) for x in sys.argv[1].split(",")]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 150
W_, m2 = 16, 32
model = load_model("minilm")
enc = model.encoder
split = {n: documents.documents(n) for n in ("fit", "test")}


def parts(b, size):
    return length_batches(b.input_ids, b.mask, np.arange(len(b)), size)


data = {n: parts(split[n], 4) for n in split}


def hidden_states(ids, mask, layer):
    """The exact model's input to ``layer``."""
    h = enc.embed(np.asarray(ids))
    for before in range(layer):
        context = exact_attention(*enc.qkv(h, before), mask.astype(bool), before)
        h = enc.finish_layer(h, context, before)
    return h


def masks(mask):
    L = mask.shape[1]
    t = np.arange(L)
    near = (np.abs(t[:, None] - t[None, :]) < W_) | (t[None, :] == 0)
    exact = near[None] | sep_mask(mask)[:, None, :]
    keep = mask.astype(bool)[:, None, :]
    return torch.tensor(exact & keep)[:, None], torch.tensor(keep & ~exact)[:, None]


def log_features(x, P, mode, side):
    """log phi(x) of the map form ``mode``; ``side`` is "q" or "k"."""
    if mode == "free":
        return torch.log_softmax(x @ P["f" + side] + P["fb" + side][:, None], -1)
    if mode == "rf":
        return x @ P["r" + side] - (x * x).sum(-1, keepdim=True) / 2 * x.shape[-1] ** -0.5
    u = x @ P["w" + side] + P["b" + side][:, None]
    if mode == "mlp":
        u = u + torch.relu(x @ P["A" + side] + P["a" + side][:, None]) @ P["B" + side]
    if mode == "exp":
        return torch.cat([u, -u], -1)
    if mode == "split":
        return torch.cat([torch.log_softmax(u, -1), torch.log_softmax(-u, -1)], -1)
    return torch.log_softmax(torch.cat([u, -u], -1), -1)


def forward(q, k, v, near, far, P, mode, same=None):
    if mode == "same":  # keys holding the query's own token: exact too
        near, far = near | same, far & ~same
    s = q.shape[-1] ** -0.5
    logits = s * q @ k.transpose(-1, -2)
    if mode == "base":
        return torch.softmax(torch.where(near, logits, torch.tensor(-torch.inf)), -1) @ v
    lq = log_features(q, P, mode, "q")
    lk = log_features(k, P, mode, "k") + P["lg"][:, None, None]
    if mode == "dir":  # far keys after the query: their own query map and far weight
        lq2 = torch.log_softmax(torch.cat([u := q @ P["wq2"] + P["bq2"][:, None], -u], -1), -1)
        lk2 = lk - P["lg"][:, None, None] + P["lg2"][:, None, None]
    if mode in ("qscale", "both"):
        lq = lq + (q @ P["a"][:, :, None]) + P["c"][:, None, None]
    if mode in ("kscale", "both"):
        lk = lk + (k @ P["ak"][:, :, None])
    # log of far weights: logsumexp over features
    mq = lq.amax(-1, keepdim=True).detach()
    mk = lk.amax(-1, keepdim=True).detach()
    lfar = (
        torch.log((lq - mq).exp() @ (lk - mk).exp().transpose(-1, -2)) + mq + mk.transpose(-1, -2)
    )
    if mode == "dir":
        mq2, mk2 = lq2.amax(-1, keepdim=True).detach(), lk2.amax(-1, keepdim=True).detach()
        later = torch.log((lq2 - mq2).exp() @ (lk2 - mk2).exp().transpose(-1, -2))
        later = later + mq2 + mk2.transpose(-1, -2)
        t = torch.arange(q.shape[-2])
        lfar = torch.where(t[None, :] > t[:, None], later, lfar)
    if mode == "rowmax":  # LoLCATs' form: near weights stabilised by their row maximum
        lfar = lfar + torch.where(near, logits, torch.tensor(-torch.inf)).amax(-1, keepdim=True)
    if mode == "mass":  # oracle: each row's far part carries the exact far mass
        exact_mass = torch.where(far, logits, torch.tensor(-torch.inf)).logsumexp(-1, keepdim=True)
        mapped = torch.where(far, lfar, torch.tensor(-torch.inf)).logsumexp(-1, keepdim=True)
        shift = exact_mass - mapped  # (the gradient moves the distribution only)
        lfar = lfar + torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    if mode == "decay":
        t = torch.arange(q.shape[-2], dtype=q.dtype)
        lfar = lfar - P["rho"].exp()[:, None, None] * (t[:, None] - t[None, :]).abs()
    big = torch.where(near, logits, torch.where(far, lfar, torch.tensor(-torch.inf)))
    w = torch.softmax(big, -1)
    return w @ v


for layer in layer_ids:

    def lb(n, layer=layer):
        out = []
        for ids, mask in data[n]:
            q, k, v = enc.qkv(hidden_states(ids, mask, layer), layer)
            near, far = masks(mask)
            same = far & torch.tensor(ids[:, :, None] == ids[:, None, :])[:, None]
            rows = torch.tensor(mask.astype(bool))[:, None, :, None]
            qt, kt, vt = (torch.tensor(np.asarray(x, np.float32)) for x in (q, k, v))
            exact = (
                torch.softmax(
                    torch.where(
                        torch.tensor(mask.astype(bool))[:, None, None, :],
                        qt.shape[-1] ** -0.5 * qt @ kt.transpose(-1, -2),
                        torch.tensor(-torch.inf),
                    ),
                    -1,
                )
                @ vt
            )
            out.append((qt, kt, vt, near, far, rows, exact, same))
        return out

    fit, test = lb("fit"), lb("test")
    H, d = fit[0][0].shape[1], fit[0][0].shape[-1]

    def err(P, mode, batches, heads=None):
        num = den = 0.0
        with torch.no_grad():
            for q, k, v, near, far, rows, exact, same in batches:
                o = forward(q, k, v, near, far, P, mode, same)
                num = num + (((o - exact) ** 2) * rows).sum((0, 2, 3))
                den = den + ((exact**2) * rows).sum((0, 2, 3))
        if heads is not None:  # per head: error, share of the layer's output norm
            heads[mode] = [round(x, 3) for x in (num / den).sqrt().tolist()]
            heads["norm share"] = [round(x, 3) for x in (den / den.sum()).tolist()]
        return (num.sum() / den.sum()).item() ** 0.5

    per_head: dict = {}
    res = {"base": err({}, "base", test, per_head)}
    for mode in sys.argv[3].split(","):
        torch.manual_seed(0)
        eye = torch.eye(d)[:, :m2].repeat(H, 1, 1)
        P = {
            "wq": eye.clone(),
            "bq": torch.zeros(H, m2),
            "wk": eye.clone(),
            "bk": torch.zeros(H, m2),
            "lg": torch.zeros(H),
            "a": torch.zeros(H, d),
            "c": torch.zeros(H),
            "ak": torch.zeros(H, d),
            "rho": torch.full((H,), -6.0),
            "wq2": eye.clone(),
            "bq2": torch.zeros(H, m2),
        }
        for side in "qk":
            P["f" + side] = torch.cat([eye, -eye], -1)
            P["fb" + side] = torch.zeros(H, 2 * m2)
            P["A" + side] = torch.randn(H, d, 128) * d**-0.5
            P["a" + side] = torch.zeros(H, 128)
            P["B" + side] = torch.zeros(H, 128, m2)
        P["rq"] = torch.randn(H, d, 2 * m2) * d**-0.25
        P["rk"] = P["rq"].clone()
        with torch.no_grad():  # g from the median exact / mapped far-mass ratio (batch 0)
            q, k, v, near, far, rows, exact, _ = fit[0]
            s_ = d**-0.5
            ex = torch.where(far, (s_ * q @ k.transpose(-1, -2)).exp(), torch.tensor(0.0)).sum(-1)
            fq = log_features(q, P, mode, "q").exp()
            fk = log_features(k, P, mode, "k").exp()
            mp = torch.where(far, fq @ fk.transpose(-1, -2), torch.tensor(0.0)).sum(-1)
            ratio = (ex / mp.clamp_min(1e-30)).log()
            if mode == "rowmax":  # the far weights carry the row's largest near logit
                logits = s_ * q @ k.transpose(-1, -2)
                ratio = ratio - torch.where(near, logits, torch.tensor(-torch.inf)).amax(-1)
            sel = rows[..., 0].expand_as(ratio) & (mp > 0)
            for h in range(H):
                P["lg"][h] = ratio[:, h][sel[:, h]].median()
            P["lg2"] = P["lg"].clone()
        for x in P.values():
            x.requires_grad_(True)
        opt = torch.optim.Adam(P.values(), lr=0.01)
        t0 = time.time()
        for step in range(steps):
            q, k, v, near, far, rows, exact, same = fit[step % len(fit)]
            o = forward(q, k, v, near, far, P, mode, same)
            loss = (((o - exact) ** 2) * rows).sum() / rows.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        res[mode] = err(P, mode, test, per_head)
        res[mode + "_fit"] = err(P, mode, fit)
        res[mode + "_s"] = round(time.time() - t0, 1)
    print(
        layer,
        {k: round(v, 4) for k, v in res.items()},
        {m: round(res[m] / res["base"], 3) for m in sys.argv[3].split(",")},
        flush=True,
    )
    for name, values in per_head.items():
        print(f"  per head, {name}:", values, flush=True)
