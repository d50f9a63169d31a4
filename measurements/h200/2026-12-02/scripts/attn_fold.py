"""Device experiment: the prompt attention kernel with one loop per chunk (current) against the folded chunk loop,
a few tilings; small preset heads, one slot, causal prefill; median ms (do_bench), bytes against the current."""
import sys
from dataclasses import replace

import torch

sys.path.insert(0, "benchmarks")
import bench_gpu_kernels as bg  # noqa: E402
from exactness.config import get_preset  # noqa: E402
from exactness.kernels import triton_attention as ta  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

c = get_preset("small")
Hq, Hkv, D = c.n_heads, c.n_kv_heads, c.head_dim
base = ta.config_for(D, torch.bfloat16, (9, 0))
A = ta.AttnConfig
cands = {"base": base, "fold": replace(base, fold=True), "fold s2": replace(base, fold=True, num_stages=2),
         "fold s4": replace(base, fold=True, num_stages=4), "fold m64 w4": A(64, 128, 4, 3, fold=True),
         "fold n64": A(128, 64, 8, 3, fold=True), "fold n64 s4": A(128, 64, 8, 4, fold=True),
         "fold m128 n128 w4": A(128, 128, 4, 3, fold=True)}
print(f"Hq {Hq} Hkv {Hkv} D {D}; base {base.label()}")
for P in (4096, 16022):
    torch.manual_seed(0)
    kc, vc, q = bg._rand(1, P, Hkv, D), bg._rand(1, P, Hkv, D), bg._rand(P, Hq, D)
    pos = torch.arange(P, device="cuda")
    slots = torch.zeros_like(pos)
    ref = ta.attention(q, kc, vc, slots, pos, base, split=False)
    qh, kh, vh = q.transpose(0, 1)[None], kc[0].transpose(0, 1)[None], vc[0].transpose(0, 1)[None]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = bg.ms(lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                                                              enable_gqa=True))
    flops = 4 * P * Hq * D * (P + 1) / 2
    line = [f"P={P} flash {flash:.3f} ms ({flops / flash / 1e9:.0f} TF/s)"]
    for label, cfg in cands.items():
        try:
            y = ta.attention(q, kc, vc, slots, pos, cfg, split=False)
            t = bg.ms(lambda: ta.attention(q, kc, vc, slots, pos, cfg, split=False))
        except Exception as e:
            line.append(f"{label} ERR {type(e).__name__}")
            continue
        same = torch.equal(y.view(torch.int16), ref.view(torch.int16))
        line.append(f"{label} {t:.3f} ms {flops / t / 1e9:.0f} TF/s{'' if same else ' DIFF'}")
    print("\n  ".join(line), flush=True)
