"""Run `python -m exactness ARGS`, then print the process's peak CUDA memory (allocated and reserved)."""
import sys, time, torch
sys.path.insert(0, "lib")
from exactness.receipt.cli import main
t0 = time.perf_counter()
rc = main(sys.argv[1:])
print(f"{sys.argv[1]}: rc {rc} in {time.perf_counter() - t0:.1f} s; peak allocated "
      f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, peak reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")
