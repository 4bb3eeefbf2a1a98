"""Cost of the per-read token-id check in InstanceDataset.read: `python scripts/bench_token_check.py`."""
import time, numpy as np, tempfile, os
from pathlib import Path
from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.mixes import source_from_paths
from olmo_eqx.data.token_files import write_token_file, TokenFile
d = Path(tempfile.mkdtemp())
vocab = 100278  # OLMo 3's dolma2 tokenizer: uint32 files
rng = np.random.default_rng(0)
for i in range(4):
    write_token_file(d / f"p{i}.npy", rng.integers(0, vocab, 16 << 20, dtype=np.uint32), vocab)
for batch, seq in [(8, 256), (32, 4096)]:
    ds = InstanceDataset([source_from_paths("t", str(d / "*.npy"))], seq, vocab)
    ids = [rng.integers(0, len(ds), batch) for _ in range(200)]
    ds.read(ids[0])
    t = time.perf_counter(); outs = [ds.read(i)[0] for i in ids]; read = (time.perf_counter() - t) / len(ids)
    t = time.perf_counter()
    for out in outs: int(out.max()) >= vocab or int(out.min()) < 0
    check = (time.perf_counter() - t) / len(ids)
    print(f"batch {batch} x {seq}: read() {read*1e3:.3f} ms/batch incl. check, of which the check {check*1e3:.4f} ms ({100*check/read:.1f}%)")
f = TokenFile(d / "p0.npy", vocab)
t = time.perf_counter(); f.check_token_ids(); full = time.perf_counter() - t
print(f"for comparison, the eager whole-file scan (check_token_ids): {f.num_tokens/full/1e6:.0f} M tokens/s")
