import torch, offload
from offload._reference import ReferenceModel
torch.manual_seed(0)
m = ReferenceModel(8, 4096, 32, 14336, device="cuda", dtype=torch.bfloat16)
x = torch.randn(1, 4096, 4096, device="cuda", dtype=torch.bfloat16)
G = 2**30
def run(levers):
    p = offload.Plan(m.layers, levers).apply()
    for it in range(2):
        m.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
        with p:
            loss = m.loss(x)
        torch.cuda.synchronize()
        fwd_end = torch.cuda.memory_allocated() - base
        fwd_peak = torch.cuda.max_memory_allocated() - base
        loss.backward(); torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    st = p.offloader.stats if p.offloader else None
    rel = [ (round(l.bytes_offloaded/G,3), round(l.bytes_released/G,3)) for l in st.layers[:3]] if st else None
    print("".join({"keep":".","offload":"o","selective":"s","checkpoint":"c","selective_offload":"S"}[v] for v in levers),
          f"fwd_end {fwd_end/G:.3f} fwd_peak {fwd_peak/G:.3f} peak {peak/G:.3f}", rel)
    p.remove()
for lv in (["selective"]*7+["keep"], ["selective_offload"]*3+["selective"]*4+["keep"], ["offload"]*3+["selective"]*4+["keep"], ["selective_offload"]+["keep"]*7):
    run(lv)
