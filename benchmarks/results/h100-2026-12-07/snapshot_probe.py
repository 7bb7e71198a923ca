import sys, os, time
import torch
mode = sys.argv[1]
torch.empty(1, device="cuda")
C = torch._C
if mode == "bogus":
    r = C._cuda_memorySnapshot((12345678, 87654321, False))
elif mode == "mempool":
    p = torch.cuda.MemPool()
    print("pool id", p.id)
    r = C._cuda_memorySnapshot((p.id[0], p.id[1], False))
    print("segments", len(r["segments"]), r["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"])
    keep = [torch.empty(512, device="cuda") for _ in range(50000)]
    def t(fn, n=2000):
        best = 1e9
        for _ in range(5):
            s = time.perf_counter()
            for _ in range(n): fn()
            best = min(best, (time.perf_counter() - s) / n)
        return best * 1e6
    print("mempool snapshot at 50k blocks us", t(lambda: C._cuda_memorySnapshot((p.id[0], p.id[1], False))))
    print("full snapshot at 50k blocks us", t(lambda: C._cuda_memorySnapshot(None), 5))
    print("setter us", t(lambda: C._accelerator_setAllocatorSettings("expandable_segments:False")))
sys.path.insert(0, os.getcwd())
import hybridmem, json, email.mime.text, http.client, asyncio
print(mode, "imported ok", flush=True)
