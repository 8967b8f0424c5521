"""Attention-transfer prototype (issue 26, step 1): fitted Hedgehog maps in the hybrid.

A research prototype in torch autograd, written densely enough to be obviously right,
whose figures choose the map, ``m`` and the stitching for the library's build-out.  It
runs the real all-MiniLM-L6-v2 (transformers' BertModel, its self-attention replaced
through ``AttentionInterface``) layer by layer, and for each head fits

* a query map and a key map ``phi(x)_j = softmax_j([x W + b, -(x W + b)])``
  (``W`` of shape ``d x m/2`` from the identity, ``b`` from zero), and
* a far weight ``g = exp(rho) >= 0`` per head,

inside the hybrid ``out = (N_near + g' N_far) / (D_near + g' D_far)``: near = exact
softmax weights over the bidirectional window ``|i - j| <= w`` plus the sink keys
(position 0 and the row's ``[SEP]``), far = ``phi(q) . phi(k)`` over every other real
key.  ``--mix`` sets ``g'``:

* ``raw``: ``g' = g``, near weights ``exp(s q.k)`` as they are (the issue's form; a row's
  near mass then scales with ``exp`` of its scores while the map's does not);
* ``rowmax``: ``g' = g exp(max_near s q.k)`` per query row (LoLCATs' form: near weights
  stabilised by the row's largest near score, far weights not);
* ``qscale``: ``raw`` times ``exp(q . u)`` with a fitted ``u`` per head (a per-row scale).

Loss: mean squared error between the hybrid's and the exact softmax attention output of
the layer over real query rows (attention transfer), model weights frozen; Adam; early
stopping on the validation split per head (a head's parameters touch only its own
output); ``g = 0`` for a head whose best validation error does not beat window + sinks.

Stitching: (a) every layer fitted on the exact model's activations; (b) layer by
layer, layer ``l`` fitted on the activations produced with layers ``< l`` converted;
(c) (b) then a short end-to-end fit of all maps and weights against the exact model's
final hidden states (``--e2e-steps``; kept only if it raises the validation cosine).

Figures, on the TEST split (``benchmarks/documents.py``: split by topic):

* per layer, the relative attention-output error ``||A - A*||_F / ||A*||_F`` over real
  query rows of all heads (plain relative error, as ``linattn.models.accuracy``), of
  window + sinks and of the fitted hybrid, on the exact model's activations ("exact
  acts") and on the activations of the stitched converted model itself ("own acts");
* end to end, the mean and minimum cosine of the mean-pooled, normalised embeddings to
  the exact model's (all rows; 128+ tokens);
* the fit's wall time (1 thread).

    python benchmarks/transfer_prototype.py --quick
    python benchmarks/transfer_prototype.py --data docs --window 16 --m 64 --stitch a b
    python benchmarks/transfer_prototype.py --data texts --window 16 --m 32 64
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import documents

CHUNK = 8  # rows per forward chunk


# ---------------------------------------------------------------------------- attention


@dataclass
class Ctx:
    """What the attention function needs besides q, k, v: set around each forward."""

    mask: torch.Tensor | None = None  # (B, L) bool, real tokens
    sep: torch.Tensor | None = None  # (B,) long, each row's [SEP] (last real token)
    window: int = 16
    mix: str = "raw"
    params: dict = field(default_factory=dict)  # layer -> parameter dict, absent: exact


CTX = Ctx()


def exact_attention(q, k, v, mask, scaling):
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scaling
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def shifts(x: torch.Tensor, w: int):
    """The ``2w+1`` views ``y_p[..., i, :] = x[..., i - w + p, :]`` (0 outside): no copies."""
    L = x.shape[2]
    xp = F.pad(x, (0, 0, w, w))
    return [xp[:, :, p : p + L] for p in range(2 * w + 1)]


def band_mask(mask: torch.Tensor, w: int) -> torch.Tensor:
    """``(B, 1, L, 2w+1)``: whether key ``i - w + p`` exists and is real."""
    mp = F.pad(mask.float(), (w, w))
    L = mask.shape[1]
    return torch.stack([mp[:, p : p + L] for p in range(2 * w + 1)], dim=-1)[:, None] > 0


def sink_rows(x: torch.Tensor, sep: torch.Tensor) -> torch.Tensor:
    """``(B, H, L, c) -> (B, H, 2, c)``: position 0 and each row's ``[SEP]``."""
    index = sep[:, None, None, None].expand(-1, x.shape[1], 1, x.shape[-1])
    return torch.cat([x[:, :, :1], torch.gather(x, 2, index)], dim=2)


def near_masks(mask: torch.Tensor, sep: torch.Tensor, w: int):
    """Band validity ``(B, 1, L, 2w+1)`` and sink-not-in-band ``(B, 1, L, 2)``."""
    L = mask.shape[1]
    band_ok = band_mask(mask, w)
    i = torch.arange(L)
    sink0 = (i > w)[None, :].expand(mask.shape[0], L)
    sinks = (i[None, :] - sep[:, None]).abs() > w
    return band_ok, torch.stack([sink0, sinks], dim=-1)[:, None]


def near_part(q, k, v, mask, sep, w, scaling):
    """Exact weights over window + sinks, stabilised by the row's near maximum ``c``."""
    band_ok, sink_ok = near_masks(mask, sep, w)
    s_band = torch.stack([(q * kp).sum(-1) for kp in shifts(k, w)], dim=-1) * scaling
    s_sink = torch.einsum("bhld,bhsd->bhls", q, sink_rows(k, sep)) * scaling
    s = torch.cat(
        [s_band.masked_fill(~band_ok, float("-inf")), s_sink.masked_fill(~sink_ok, float("-inf"))],
        dim=-1,
    )
    c = s.amax(dim=-1)
    e = torch.exp(s - c[..., None])
    p = 2 * w + 1
    n = sum(e[..., i, None] * vp for i, vp in enumerate(shifts(v, w))) + torch.einsum(
        "bhls,bhsd->bhld", e[..., p:], sink_rows(v, sep)
    )
    return n, e.sum(-1), c


def feature_map(x, W, b):
    """Hedgehog map with a bias: ``softmax([xW + b, -(xW + b)])``, ``W`` ``(H, d, m/2)``."""
    z = torch.einsum("bhld,hdn->bhln", x, W) + b[None, :, None, :]
    return torch.softmax(torch.cat([z, -z], dim=-1), dim=-1)


def local_part(fq, fk, v, w):
    """``sum over |i - j| <= w of fq_i . fk_j (v_j, 1)`` by blocks of queries (block matmuls)."""
    B, H, L, m = fq.shape
    bq = max(32, w)
    nb = -(-L // bq)
    extra = nb * bq - L
    fq_b = F.pad(fq, (0, 0, 0, extra)).view(B, H, nb, bq, m)
    fk_w = F.pad(fk, (0, 0, w, extra + w)).unfold(2, bq + 2 * w, bq)  # (B, H, nb, m, bq+2w)
    v_w = F.pad(v, (0, 0, w, extra + w)).unfold(2, bq + 2 * w, bq)
    r = torch.arange(bq)[:, None]
    c = torch.arange(bq + 2 * w)[None, :]
    a = (fq_b @ fk_w) * ((c - r >= 0) & (c - r <= 2 * w))
    n = (a @ v_w.transpose(-1, -2)).reshape(B, H, nb * bq, -1)[:, :, :L]
    return n, a.sum(-1).reshape(B, H, nb * bq)[:, :, :L]


def far_part(fq, fk, v, mask, sep, w):
    """``sum over far keys of fq . fk (v, 1)``: all real keys minus window and sinks."""
    fk = fk * mask[:, None, :, None]
    n_all = fq @ torch.einsum("bhlm,bhld->bhmd", fk, v)
    d_all = fq @ fk.sum(2)[..., None]
    n_band, d_band = local_part(fq, fk, v, w)  # pads and outside are 0
    _, sink_ok = near_masks(mask, sep, w)
    a_sink = torch.einsum("bhlm,bhsm->bhls", fq, sink_rows(fk, sep)) * sink_ok
    n = n_all - n_band
    n = n - torch.einsum("bhls,bhsd->bhld", a_sink, sink_rows(v, sep))
    d = d_all[..., 0] - d_band - a_sink.sum(-1)
    return n, d.clamp_min(0)


def log_mult(params, q, c, mix):
    """``log g'`` per row ``(B, H, L)`` (see the module docstring)."""
    lg = params["rho"][None, :, None] + torch.zeros_like(c)
    if mix in ("raw", "qscale"):
        lg = lg - c
    if mix == "qscale":
        lg = lg + torch.einsum("bhld,hd->bhl", q, params["u"])
    return lg


def combine(params, q, k, v, mask, sep, w, scaling, mix, near=None):
    nn_, dn, c = near if near is not None else near_part(q, k, v, mask, sep, w, scaling)
    if params is None:
        return nn_ / dn[..., None]
    fq = feature_map(q, params["Wq"], params["bq"])
    fk = feature_map(k, params["Wk"], params["bk"])
    nf, df = far_part(fq, fk, v, mask, sep, w)
    mult = torch.exp(log_mult(params, q, c, mix)) * (~params["off"])[None, :, None]
    return (nn_ + mult[..., None] * nf) / (dn + mult * df)[..., None]


def attention_fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    layer = module.layer_idx
    if layer in CTX.params:
        p = CTX.params[layer]
        out = combine(
            None if p == "ws" else p,
            query,
            key,
            value,
            CTX.mask,
            CTX.sep,
            CTX.window,
            scaling,
            CTX.mix,
        )
    else:
        out = exact_attention(query, key, value, CTX.mask, scaling)
    return out.transpose(1, 2).contiguous(), None


# ---------------------------------------------------------------------------- the model


def load_model():
    from transformers import AttentionInterface, BertModel

    AttentionInterface.register("transfer_prototype", attention_fn)
    model = BertModel.from_pretrained(
        str(documents.model_folder()), attn_implementation="transfer_prototype"
    )
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def set_rows(mask: torch.Tensor) -> None:
    CTX.mask = mask
    CTX.sep = mask.sum(1) - 1


def embed_layer(model, ids):
    with torch.no_grad():
        return model.embeddings(input_ids=ids)


def run_layer(model, layer, hidden, mask):
    """Layer ``layer`` on ``hidden`` in chunks, attention as ``CTX.params`` says."""
    outs = []
    for s in range(0, hidden.shape[0], CHUNK):
        set_rows(mask[s : s + CHUNK])
        outs.append(model.encoder.layer[layer](hidden[s : s + CHUNK]))
    return torch.cat(outs)


def qkv(model, layer, hidden):
    att = model.encoder.layer[layer].attention.self
    B, L, _ = hidden.shape
    shape = (B, L, -1, att.attention_head_size)
    with torch.no_grad():
        return tuple(
            lin(hidden).view(shape).transpose(1, 2).contiguous()
            for lin in (att.query, att.key, att.value)
        ), att.scaling


def pooled(hidden, mask):
    w = mask[..., None].to(hidden.dtype)
    return F.normalize((hidden * w).sum(1) / w.sum(1), dim=-1)


def forward_all(model, ids, mask, params, grad=False):
    """Every layer's input hidden states ``[H_0, ..., H_6]`` with ``params`` converted."""
    CTX.params = params
    with torch.set_grad_enabled(grad):
        h = [embed_layer(model, ids)]
        for layer in range(len(model.encoder.layer)):
            h.append(run_layer(model, layer, h[-1], mask))
    CTX.params = {}
    return h


# ---------------------------------------------------------------------------- the fit


def init_params(H, d, m, mix, seed):
    g = torch.Generator().manual_seed(seed)
    half = m // 2
    eye = torch.zeros(d, half)
    for j in range(half):
        eye[j % d, j] = 1.0

    def w0():
        return eye[None].repeat(H, 1, 1) + 0.01 * torch.randn(H, d, half, generator=g)

    p = {
        "Wq": w0(),
        "bq": torch.zeros(H, half),
        "Wk": w0(),
        "bk": torch.zeros(H, half),
        "rho": torch.zeros(H),
    }
    if mix == "qscale":
        p["u"] = torch.zeros(H, d)
    for t in p.values():
        t.requires_grad_(True)
    p["off"] = torch.zeros(H, dtype=torch.bool)
    return p


def trainable(p):
    return [t for name, t in p.items() if name != "off"]


def snapshot(p):
    return {n: t.detach().clone() for n, t in p.items()}


@dataclass
class LayerData:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor
    sep: torch.Tensor
    scaling: float
    y: torch.Tensor = None  # exact output
    near: tuple = None


def layer_data(model, layer, hidden, mask, w):
    (q, k, v), scaling = qkv(model, layer, hidden)
    sep = mask.sum(1) - 1
    d = LayerData(q, k, v, mask, sep, scaling)
    with torch.no_grad():
        ys, ns = [], []
        for s in range(0, q.shape[0], CHUNK):
            sl = slice(s, s + CHUNK)
            ys.append(exact_attention(q[sl], k[sl], v[sl], mask[sl], scaling))
            ns.append(near_part(q[sl], k[sl], v[sl], mask[sl], sep[sl], w, scaling))
    d.y = torch.cat(ys)
    d.near = tuple(torch.cat([n[i] for n in ns]) for i in range(3))
    return d


def head_sq_err(out, y, mask):
    """Per-head sum of squared errors over real query rows, and the row count."""
    m = mask[:, None, :, None].to(out.dtype)
    return (((out - y) ** 2) * m).sum(dim=(0, 2, 3)), m.sum() * out.shape[-1]


def evaluate(params, d: LayerData, w, mix):
    """Per-head squared error ``(H,)`` and the squared norm of the exact output."""
    err = 0.0
    with torch.no_grad():
        for s in range(0, d.q.shape[0], CHUNK):
            sl = slice(s, s + CHUNK)
            near = tuple(t[sl] for t in d.near)
            out = combine(
                params, d.q[sl], d.k[sl], d.v[sl], d.mask[sl], d.sep[sl], w, d.scaling, mix, near
            )
            err = err + head_sq_err(out, d.y[sl], d.mask[sl])[0]
    norm = (d.y**2 * d.mask[:, None, :, None]).sum()
    return err, norm


def fit_layer(fit: LayerData, val: LayerData, args, m, seed):
    H, d = fit.q.shape[1], fit.q.shape[-1]
    p = init_params(H, d, m, args.mix, seed)
    w, mix = args.window, args.mix
    # g's start: per head, the median over rows of the exact far mass over the map's.
    with torch.no_grad():
        sl = slice(0, min(8, fit.q.shape[0]))
        q, k, v, mask, sep = fit.q[sl], fit.k[sl], fit.v[sl], fit.mask[sl], fit.sep[sl]
        s = torch.einsum("bhid,bhjd->bhij", q, k) * fit.scaling
        _, dn, c = (t[sl] for t in fit.near)
        e = torch.exp(s - c[..., None]) * mask[:, None, None, :]
        far_exact = e.sum(-1) - dn
        fq = feature_map(q, p["Wq"], p["bq"])
        fk = feature_map(k, p["Wk"], p["bk"])
        _, df = far_part(fq, fk, v, mask, sep, w)
        ratio = far_exact.clamp_min(1e-30) / (torch.exp(log_mult(p, q, c, mix)) * df).clamp_min(
            1e-30
        )
        rows = mask[:, None, :].expand_as(ratio)
        for h in range(H):
            p["rho"].data[h] = torch.log(ratio[:, h][rows[:, h]]).median()
    base_val, _ = evaluate(None, val, w, mix)
    best_val, _ = evaluate(p, val, w, mix)
    best = snapshot(p)
    opt = torch.optim.Adam(trainable(p), lr=args.lr)
    gen = torch.Generator().manual_seed(seed)
    N = fit.q.shape[0]
    since = 0
    step = 0
    for step in range(1, args.steps + 1):
        idx = torch.randperm(N, generator=gen)[: args.batch]
        out = combine(
            p,
            fit.q[idx],
            fit.k[idx],
            fit.v[idx],
            fit.mask[idx],
            fit.sep[idx],
            w,
            fit.scaling,
            mix,
            tuple(t[idx] for t in fit.near),
        )
        sq, count = head_sq_err(out, fit.y[idx], fit.mask[idx])
        loss = sq.sum() / count
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.eval_every == 0 or step == args.steps:
            err, _ = evaluate(p, val, w, mix)
            better = err < best_val
            if better.any():
                since = 0
                for name, t in p.items():
                    if name != "off":
                        best[name][better] = t.detach()[better]
                best_val = torch.where(better, err, best_val)
            else:
                since += 1
                if since >= args.patience:
                    break
    for name in best:
        if name != "off":
            best[name].requires_grad_(True)
    best["off"] = best_val >= base_val
    return best, step


def rel_err(params, d: LayerData, w, mix):
    err, norm = evaluate(params, d, w, mix)
    return math.sqrt(float(err.sum() / norm))


# ---------------------------------------------------------------------------- stitching


def data_split(kind, split, quick):
    batch = documents.documents(split) if kind == "docs" else documents.committed_texts(split)
    n = {"fit": 4, "validation": 2, "test": 4}[split] if quick else len(batch)
    if kind == "texts" and quick:
        n *= 2
    return torch.from_numpy(batch.input_ids[:n]), torch.from_numpy(batch.mask[:n])


def cosines(model, ids, mask, params, exact_emb):
    h = forward_all(model, ids, mask, params)
    cos = (pooled(h[-1], mask) * exact_emb).sum(-1)
    return cos, h


def stitch(model, splits, exact_h, args, m, how):
    """Fit every layer; ``how`` 'a' on the exact activations, 'b' on the converted ones."""
    n_layers = len(model.encoder.layer)
    params, steps, fit_time = {}, [], 0.0
    h = {s: exact_h[s][0] for s in ("fit", "validation")}
    for layer in range(n_layers):
        src = {s: (exact_h[s][layer] if how == "a" else h[s]) for s in h}
        t0 = time.perf_counter()
        fit = layer_data(model, layer, src["fit"], splits["fit"][1], args.window)
        val = layer_data(model, layer, src["validation"], splits["validation"][1], args.window)
        p, n = fit_layer(fit, val, args, m, seed=args.seed + layer)
        params[layer] = p
        if how == "b":
            CTX.params = {layer: p}
            with torch.no_grad():
                for s in h:
                    h[s] = run_layer(model, layer, h[s], splits[s][1])
            CTX.params = {}
        fit_time += time.perf_counter() - t0
        steps.append(n)
        print(
            f"    [{how}] layer {layer}: {n} steps, heads off {int(p['off'].sum())}, "
            f"log g {p['rho'].detach().numpy().round(1).tolist()}",
            flush=True,
        )
    return params, steps, fit_time


def e2e_fit(model, params, splits, exact_h, args):
    """(c): all maps and weights against the exact final hidden states (MSE, real tokens)."""
    ids, mask = splits["fit"]
    target = exact_h["fit"][-1]
    vids, vmask = splits["validation"]
    vemb = pooled(exact_h["validation"][-1], vmask)
    best = {l: snapshot(p) for l, p in params.items()}
    best_cos = cosines(model, vids, vmask, params, vemb)[0].mean()
    leaves = [t for p in params.values() for t in trainable(p)]
    opt = torch.optim.Adam(leaves, lr=args.e2e_lr)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    for step in range(1, args.e2e_steps + 1):
        idx = torch.randperm(ids.shape[0], generator=gen)[: args.e2e_batch]
        h = forward_all(model, ids[idx], mask[idx], params, grad=True)[-1]
        mk = mask[idx][..., None].to(h.dtype)
        loss = (((h - target[idx]) ** 2) * mk).sum() / (mk.sum() * h.shape[-1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % max(1, args.e2e_steps // 4) == 0 or step == args.e2e_steps:
            cos = cosines(model, vids, vmask, params, vemb)[0].mean()
            print(f"    [c] step {step} loss {loss.item():.4g} val cos {cos:.4f}", flush=True)
            if cos > best_cos:
                best_cos, best = cos, {l: snapshot(p) for l, p in params.items()}
    return best, time.perf_counter() - t0


def per_layer_errors(model, params, test, exact_h, args):
    """Per layer: (w+s, fitted) on the exact activations, and on the converted model's own."""
    ids, mask = test
    own_h = forward_all(model, ids, mask, params)
    rows = []
    for layer in range(len(model.encoder.layer)):
        ex = layer_data(model, layer, exact_h[layer], mask, args.window)
        own = layer_data(model, layer, own_h[layer], mask, args.window)
        rows.append(
            (
                rel_err(None, ex, args.window, args.mix),
                rel_err(params[layer], ex, args.window, args.mix),
                rel_err(None, own, args.window, args.mix),
                rel_err(params[layer], own, args.window, args.mix),
            )
        )
    return rows


def summary(cos, mask):
    long_ = mask.sum(1) >= 128
    c = cos.numpy()
    return c.mean(), c.min(), c[long_.numpy()].mean() if long_.any() else float("nan")


def brief(row) -> str:
    return f"mean {row[2]:.4f} min {row[3]:.4f} 128+ {row[4]:.4f}"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="few rows, few steps")
    ap.add_argument("--data", choices=("docs", "texts"), default="docs")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--m", type=int, nargs="+", default=[64])
    ap.add_argument("--stitch", nargs="+", default=["a", "b"], choices=("a", "b", "c"))
    ap.add_argument("--mix", choices=("raw", "rowmax", "qscale"), default="raw")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--e2e-steps", type=int, default=30)
    ap.add_argument("--e2e-batch", type=int, default=2)
    ap.add_argument("--e2e-lr", type=float, default=2e-3)
    ap.add_argument("--layers-table", action="store_true", help="per-layer errors too")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.eval_every, args.e2e_steps = (
            min(args.steps, 20),
            10,
            min(args.e2e_steps, 4),
        )
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    CTX.window, CTX.mix = args.window, args.mix

    model = load_model()
    splits = {s: data_split(args.data, s, args.quick) for s in documents.SPLITS}
    t0 = time.perf_counter()
    exact_h = {s: forward_all(model, *splits[s], {}) for s in documents.SPLITS}
    print(
        f"data {args.data}: "
        + ", ".join(
            f"{s} {splits[s][0].shape[0]}x{splits[s][0].shape[1]}" for s in documents.SPLITS
        )
        + f"; exact passes {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    ids, mask = splits["test"]
    exact_emb = pooled(exact_h["test"][-1], mask)
    n_layers = len(model.encoder.layer)
    results = []
    ws = dict.fromkeys(range(n_layers), "ws")
    cos, _ = cosines(model, ids, mask, ws, exact_emb)
    results.append((f"w={args.window}+sinks", "-", *summary(cos, mask), 0.0, None))
    print(
        f"  window + sinks: {brief(results[-1])}",
        flush=True,
    )
    layer_tables = {}
    for m in args.m:
        kept = {}
        for how in [h for h in args.stitch if h != "c"] + (
            ["b"] if "c" in args.stitch and "b" not in args.stitch else []
        ):
            params, steps, seconds = stitch(model, splits, exact_h, args, m, how)
            kept[how] = (params, seconds)
            if how in args.stitch:
                cos, _ = cosines(model, ids, mask, params, exact_emb)
                results.append((f"fitted m={m}", how, *summary(cos, mask), seconds, steps))
                print(
                    f"  m={m} ({how}): {brief(results[-1])} fit {seconds:.0f}s",
                    flush=True,
                )
                if args.layers_table:
                    layer_tables[(m, how)] = per_layer_errors(
                        model, params, splits["test"], exact_h["test"], args
                    )
        if "c" in args.stitch:
            params, seconds_b = kept["b"]
            params = {
                l: {n: (t.detach().clone().requires_grad_(n != "off")) for n, t in p.items()}
                for l, p in params.items()
            }
            params, seconds = e2e_fit(model, params, splits, exact_h, args)
            cos, _ = cosines(model, ids, mask, params, exact_emb)
            results.append((f"fitted m={m}", "c", *summary(cos, mask), seconds_b + seconds, None))
            print(
                f"  m={m} (c): {brief(results[-1])}",
                flush=True,
            )
            if args.layers_table:
                layer_tables[(m, "c")] = per_layer_errors(
                    model, params, splits["test"], exact_h["test"], args
                )

    print(
        f"\n## {args.data}, w={args.window} + sinks, mix={args.mix}, "
        f"test {ids.shape[0]} rows (L<={ids.shape[1]}), steps<={args.steps}\n"
    )
    print("| config | stitch | mean cos | min cos | mean cos 128+ | 1-cos vs w+s | fit s |")
    print("|---|---|---|---|---|---|---|")
    base = 1 - results[0][2]
    for name, how, mean, mn, long_, sec, _ in results:
        print(
            f"| {name} | {how} | {mean:.4f} | {mn:.4f} | {long_:.4f} | "
            f"{(1 - mean) / base:.2f} | {sec:.0f} |"
        )
    for (m, how), rows in layer_tables.items():
        print(
            f"\nper-layer relative attention-output error, m={m} ({how}); "
            "||A - A*||_F / ||A*||_F over real rows\n"
        )
        print(
            "| layer | w+s (exact acts) | fitted (exact acts) | ratio | w+s (own acts) | "
            "fitted (own acts) | ratio |"
        )
        print("|---|---|---|---|---|---|---|")
        for layer, (a, b, c, d) in enumerate(rows):
            print(
                f"| {layer} | {a:.3f} | {b:.3f} | {b / a:.2f} | {c:.3f} | {d:.3f} | {d / c:.2f} |"
            )


if __name__ == "__main__":
    main()
