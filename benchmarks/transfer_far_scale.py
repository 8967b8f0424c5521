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
over the far keys).  A measurement, not a library path.

    python benchmarks/transfer_far_scale.py 0 150 fitted,qscale,kscale,both
    python benchmarks/transfer_far_scale.py 0 150 fitted,rowmax,decay,same,mass
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
hidden = {n: [enc.embed(np.asarray(ids)) for ids, _ in data[n]] for n in data}


def masks(mask):
    L = mask.shape[1]
    t = np.arange(L)
    near = (np.abs(t[:, None] - t[None, :]) < W_) | (t[None, :] == 0)
    exact = near[None] | sep_mask(mask)[:, None, :]
    keep = mask.astype(bool)[:, None, :]
    return torch.tensor(exact & keep)[:, None], torch.tensor(keep & ~exact)[:, None]


def forward(q, k, v, near, far, P, mode, same=None):
    if mode == "same":  # keys holding the query's own token: exact too
        near, far = near | same, far & ~same
    s = q.shape[-1] ** -0.5
    logits = s * q @ k.transpose(-1, -2)
    if mode == "base":
        return torch.softmax(torch.where(near, logits, torch.tensor(-torch.inf)), -1) @ v
    lq_u = q @ P["wq"] + P["bq"][:, None]
    lk_u = k @ P["wk"] + P["bk"][:, None]
    lq = torch.log_softmax(torch.cat([lq_u, -lq_u], -1), -1)
    lk = torch.log_softmax(torch.cat([lk_u, -lk_u], -1), -1) + P["lg"][:, None, None]
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
        for h, (ids, mask) in zip(hidden[n], data[n], strict=False):
            q, k, v = enc.qkv(h, layer)
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

    def err(P, mode, batches):
        num = den = 0.0
        with torch.no_grad():
            for q, k, v, near, far, rows, exact, same in batches:
                o = forward(q, k, v, near, far, P, mode, same)
                num += (((o - exact) ** 2) * rows).sum().item()
                den += ((exact**2) * rows).sum().item()
        return (num / den) ** 0.5

    res = {"base": err({}, "base", test)}
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
        }
        with torch.no_grad():  # g from the median exact / mapped far-mass ratio (batch 0)
            q, k, v, near, far, rows, exact, _ = fit[0]
            s_ = d**-0.5
            ex = torch.where(far, (s_ * q @ k.transpose(-1, -2)).exp(), torch.tensor(0.0)).sum(-1)
            lq_u = q @ P["wq"]
            lk_u = k @ P["wk"]
            fq = torch.softmax(torch.cat([lq_u, -lq_u], -1), -1)
            fk = torch.softmax(torch.cat([lk_u, -lk_u], -1), -1)
            mp = torch.where(far, fq @ fk.transpose(-1, -2), torch.tensor(0.0)).sum(-1)
            ratio = (ex / mp.clamp_min(1e-30)).log()
            if mode == "rowmax":  # the far weights carry the row's largest near logit
                logits = s_ * q @ k.transpose(-1, -2)
                ratio = ratio - torch.where(near, logits, torch.tensor(-torch.inf)).amax(-1)
            sel = rows[..., 0].expand_as(ratio) & (mp > 0)
            for h in range(H):
                P["lg"][h] = ratio[:, h][sel[:, h]].median()
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
        res[mode] = err(P, mode, test)
        res[mode + "_s"] = round(time.time() - t0, 1)
    print(
        layer,
        {k: round(v, 4) for k, v in res.items()},
        {m: round(res[m] / res["base"], 3) for m in sys.argv[3].split(",")},
        flush=True,
    )
