"""Peak device memory of the fast prompt attention on one 16,022-row slot: enable_gqa (math backend) vs repeated heads."""
import sys, torch, torch.nn.functional as F
sys.path.insert(0, "lib")
from exactness.kernels import attention as A
for P in (8192, 16022):
    g = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(1, P, 4, 128, generator=g, device="cuda").bfloat16(); vc = torch.randn_like(kc)
    q = torch.randn(P, 32, 128, generator=g, device="cuda").bfloat16()
    slots, pos = torch.zeros(P, dtype=torch.long, device="cuda"), torch.arange(P, device="cuda")
    for name in ("repeated heads (now)", "enable_gqa (before)"):
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        if name.startswith("repeated"):
            o = A.attention_fast_prompt(q, kc, vc, slots, pos)
        else:
            with A.sdpa_kernel(list(A.FAST_SDPA_BACKENDS)):
                mask = torch.arange(P, device="cuda")[None, :] <= pos[:, None]
                o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[0].transpose(0, 1)[None],
                                                   vc[0].transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
        torch.cuda.synchronize()
        print(f"P={P} {name}: peak {(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB")
        del o; torch.cuda.empty_cache()
