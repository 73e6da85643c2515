"""TorchRec's planner and embers-plan side by side on the same random table sets (plan.py's
manyN generator, seeds given), each judged by TorchRec's own cost model: max over ranks of the
summed shard perf totals. Prints one row per instance and the worst and mean embers/TorchRec
ratio. Run through plan_compare.sh (which builds embers-plan and finds the peers' python).

Usage: plan_compare.py EMBERS_PLAN_BINARY SIZES WORLDS SEEDS   e.g. ... 100,200 16,128 1,2,3
"""
import json, os, re, subprocess, sys, tempfile, time

binary, sizes, worlds, seeds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
here = os.path.dirname(os.path.abspath(__file__))
rows = []
print(f"{'tables':>6} {'ranks':>5} {'seed':>4} | {'TorchRec ms':>12} {'time s':>7} | "
      f"{'embers ms':>12} {'time s':>7} {'bound ms':>12} | {'ratio':>6} {'replica ms':>12}", flush=True)
for n in map(int, sizes.split(",")):
    for w in map(int, worlds.split(",")):
        for seed in map(int, seeds.split(",")):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = os.path.join(tmp, "tables.json")
                out = subprocess.run([sys.executable, os.path.join(here, "plan.py"), f"many{n}", str(w),
                                      str(seed), "--dump", cfg], capture_output=True, text=True, check=True).stdout
                theirs = float(re.search(r"max_rank_perf_ms=([0-9.]+)", out).group(1))
                their_time = float(re.search(r"plan_time=([0-9.]+)s", out).group(1))
                t = time.perf_counter()
                plan = json.loads(subprocess.run([binary, "plan", cfg, "--format", "json"], capture_output=True,
                                                 text=True, check=True).stdout)
                our_time = time.perf_counter() - t
            ours = plan["max_rank_perf"]
            replica = (plan.get("torchrec_search") or {}).get("max_rank_perf", float("nan"))
            rows.append(ours / theirs)
            print(f"{n:>6} {w:>5} {seed:>4} | {theirs:>12.3f} {their_time:>7.1f} | {ours:>12.3f} "
                  f"{our_time:>7.2f} {plan['lower_bound']:>12.3f} | {ours / theirs:>6.3f} {replica:>12.3f}",
                  flush=True)
print(f"instances {len(rows)}: embers/TorchRec max-rank perf worst {max(rows):.4f}, "
      f"mean {sum(rows) / len(rows):.4f} (below 1: embers' plan is faster under TorchRec's model)")
