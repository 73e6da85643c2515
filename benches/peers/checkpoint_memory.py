"""The peer of benches/checkpoint_memory.rs: saving and loading one table with its row-wise
Adagrad state the way a PyTorch / TorchRec user does (torch.save of a state dict, fsynced;
torch.load, then copied into the live tensors as load_state_dict does; and torch.load with
mmap=True), each case in a process of its own, reporting seconds and the peak resident memory
(VmHWM) above a process that only builds the table.

Usage: $(benches/peers/setup.sh) benches/peers/checkpoint_memory.py [E D]   (default 4000000 64)
"""

import os
import subprocess
import sys
import tempfile
import time

import torch


def peak_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def child(case, path, e, d):
    torch.set_num_threads(2)
    weight = torch.empty(e, d).uniform_(-0.1, 0.1)
    momentum = torch.empty(e).uniform_(0.0, 0.1)
    start = time.perf_counter()
    if case == "save":
        torch.save({"t.weight": weight, "t.momentum1": momentum}, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    elif case in ("load", "load mmap"):
        state = torch.load(path, mmap=(case == "load mmap"))
        weight.copy_(state["t.weight"])
        momentum.copy_(state["t.momentum1"])
        del state
    print(peak_mib(), time.perf_counter() - start)


def run(case, path, e, d):
    out = subprocess.run(
        [sys.executable, __file__, "--child", case, path, str(e), str(d)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return float(out[0]), float(out[1])


def main():
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    e, d = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) == 3 else (4_000_000, 64)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "table.pt")
        model, _ = run("model", path, e, d)
        print(f"torch {torch.__version__}: one table of {e} rows x {d} (f32) with row-wise state")
        print(f"table in memory: {model:.0f} MiB peak")
        print("| case | seconds | GB/s of the file | peak above the table alone |")
        print("|---|---|---|---|")
        for case in ("save", "load", "load mmap"):
            peak, s = run(case, path, e, d)
            size = os.path.getsize(path)
            print(f"| {case} | {s:.2f} | {size / s / 1e9:.2f} | {peak - model:.0f} MiB |")


if __name__ == "__main__":
    main()
