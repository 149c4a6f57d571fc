import torch, torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn
torch.manual_seed(0); dev = "cuda"
def ref(q, k, v, L):  # q (T,H,D)
    outs, s = [], 0
    for l in L:
        qi, ki, vi = (t[s:s+l].transpose(0, 1).float() for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).transpose(0, 1)); s += l
    return torch.cat(outs)
for H, Hk, D in ((2, 2, 64), (2, 1, 64), (28, 4, 128)):
  for layout in ("contig", "transposed"):
    L = [37 + 120, 137, 5 + 150, 64, 90 + 96]
    T = sum(L); cu = torch.tensor([0] + torch.tensor(L).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    base = [torch.randn(1, h, T, D, device=dev, dtype=torch.bfloat16) for h in (H, Hk, Hk)]
    go = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    def run(fn):
        leaves = [b.clone().requires_grad_() for b in base]
        if layout == "contig":
            q, k, v = (x[0].transpose(0, 1).contiguous() for x in leaves)
        else:
            q, k, v = (x[0].transpose(0, 1) for x in leaves)
        if Hk != H:
            k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
        o = fn(q, k, v); o.float().backward(go.float())
        return o.detach().float(), [x.grad.float() for x in leaves]
    o1, g1 = run(lambda q, k, v: varlen_attn(q, k, v, cu, cu, max(L), max(L), window_size=(-1, 0)))
    o2, g2 = run(lambda q, k, v: ref(q, k, v, L))
    cos = [float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0)) for a, b in zip(g1, g2)]
    print(H, Hk, D, layout, "out err", float((o1 - o2).abs().max()), "grad cos q,k,v", [round(c, 4) for c in cos], flush=True)
