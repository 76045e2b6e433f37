"""Does the order of a token's slots change the backward's time? The same ids in three
orders, ours (both modes) and cuDNN's backward in one process:

- ``asis``: cuDNN's side-by-side ids, the window's 128 rows first (blocks 0 and 1 of every
  token);
- ``rot``: each token's slots rolled by ``(t % nb) * 64`` (nb: its 64-slot blocks), so
  that consecutive tokens, which the persistent programs take at the same time, visit
  their window blocks at different steps of their tiles;
- ``shuf``: each token's slots in a random order (fast mode and cuDNN);
- ``last``: every token's window rolled to the end (fast mode).

(Run at a6c0957 with a sixth arm, the rotation done by the kernel: a launch option on the
branch ``proto/rotate-blocks``, not kept.)

The gradients are the same sums in another order (checked: cosine of grad_kv against
``asis``).

    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/slot_order_bench.py [PEER_DIR]

Prediction (docs/performance/backward.md#slot-order-and-the-window-rows-not-kept): if the tile's
fixed cost (13 us a tile against about 4-7.5 in cuDNN's main kernel) is the window rows'
reductions colliding (consecutive tokens share 127 of 128 window rows, and the programs
take consecutive tokens in near lockstep, all reducing into the same rows in the same
blocks), ``rot`` and ``shuf`` take 5-10% less time than ``asis`` in the fast mode at
K = 512-1152 and more at K = 128-160; the deterministic mode (stores, no reductions)
moves by under 2%. If the collisions are not what costs, every arm is within the run's
spread (2-3%).
"""
import json

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import best_of_ab, inputs
from side_by_side import cudnn_peer as load_peer

D = 512
cudnn_peer = load_peer()
shapes = [(4096, 64, 640), (4096, 128, 1152), (4096, 128, 512), (4096, 16, 1152), (4096, 128, 128),
          (4096, 64, 160), (32768, 64, 640)]


def reorder(idx, how, g):
    T, K = idx.shape
    if how == "asis":
        return idx
    if how == "shuf":
        perm = torch.argsort(torch.rand(T, K, device=idx.device, generator=g), dim=1)
        return torch.gather(idx, 1, perm).contiguous()
    nb = -(-K // 64)
    t = torch.arange(T, device=idx.device)
    shift = (t % nb) * 64 if how == "rot" else torch.full_like(t, min(128, K))
    cols = (torch.arange(K, device=idx.device)[None, :] + shift[:, None]) % K
    return torch.gather(idx, 1, cols).contiguous()


def cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm()).clamp_min(1e-30)).item()


for T, H, K in shapes:
    q, kv, idx, sink, do, out, lse = inputs(T, H, K, D)
    scale = D ** -0.5
    fl = 10 * T * H * K * D
    g = torch.Generator(device="cuda").manual_seed(7)
    orders = {how: reorder(idx, how, g) for how in ("asis", "rot", "shuf", "last")}
    r = dict(T=T, H=H, K=K)

    def run(det, ids):
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, ids, sink, scale, main=backward_gluon,
                                   deterministic=det)

    ref = run(False, orders["asis"])[1]
    for how in ("rot", "shuf"):
        r[f"cos_dkv_{how}"] = round(cos(run(False, orders[how])[1], ref), 7)
    arms = [("fast_" + h, False, h) for h in ("asis", "rot", "shuf", "last")]
    arms += [("det_" + h, True, h) for h in ("asis", "rot")]
    peer = {}
    if cudnn_peer is not None:
        try:
            for h in ("asis", "rot", "shuf"):
                peer[h] = cudnn_peer.make_bwd(q, kv, orders[h], sink, scale, out, lse, do)
                peer[h]()
        except Exception as e:  # noqa: BLE001
            r["cudnn_error"] = str(e)[:200]
            peer = {}
    fns = {name: (lambda det=det, h=h: run(det, orders[h])) for name, det, h in arms}
    fns.update({f"cudnn_{h}": fn for h, fn in peer.items()})
    for name, ms in best_of_ab(fns).items():
        r[f"{name}_ms"] = ms
        r[f"{name}_tflops"] = round(fl / ms / 1e9, 1)
    print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    q = kv = idx = do = out = lse = ref = orders = peer = fns = None
    torch.cuda.empty_cache()
