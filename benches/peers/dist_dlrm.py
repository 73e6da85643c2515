"""TorchRec's DistributedModelParallel on W CPU processes (torchrun, gloo), the model of
benches/dist_dlrm.rs: 26 tables x E rows, D=64, DLRM 13-512-256-64 / 512-512-256-1, every table
table-wise (planner constrained to table_wise), fused row-wise Adagrad (lr 0.01) on the tables,
Adagrad (lr 0.01) on the dense half, B samples per rank, one thread per rank.
Usage: torchrun --nproc_per_node W dist_dlrm.py [batch] [steps] [rows_per_table]"""
import os, sys, time, torch, torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim import RowWiseAdagrad
from torchrec.datasets.utils import Batch

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
B = int(sys.argv[1]) if len(sys.argv) > 1 else 512
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
E = int(sys.argv[3]) if len(sys.argv) > 3 else 100000
D, F = 64, 26
tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=D, num_embeddings=E, feature_names=[f"f{i}"])
          for i in range(F)]
ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=13,
                       dense_arch_layer_sizes=[512, 256, D], over_arch_layer_sizes=[512, 512, 256, 1]))
apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.01})
planner = EmbeddingShardingPlanner(
    topology=Topology(world_size=world, compute_device="cpu"),
    constraints={f"t{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(F)})
plan = planner.collective_plan(model, None, dist.GroupMember.WORLD)
dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan)
opt = KeyedOptimizerWrapper(dict((k, v) for k, v in dmp.named_parameters() if "sparse_arch" not in k),
                            lambda params: torch.optim.Adagrad(params, lr=0.01))
g = torch.Generator().manual_seed(100 + rank)


def batch():
    dense = torch.randn(B, 13, generator=g)
    vals = torch.randint(0, E, (F * B,), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(F)], values=vals,
                                              lengths=torch.ones(F * B, dtype=torch.int32))
    y = torch.randint(0, 2, (B,), generator=g).float()
    return Batch(dense_features=dense, sparse_features=kjt, labels=y)


data = [batch() for _ in range(8)]


def step(i):
    opt.zero_grad()
    loss, _ = dmp(data[i % len(data)])
    loss.backward()
    opt.step()


for i in range(3):
    step(i)
times = []
for i in range(steps):
    dist.barrier()
    t = time.perf_counter()
    step(i)
    times.append(time.perf_counter() - t)
dt = sorted(times)[len(times) // 2]
worst = torch.tensor([dt])
dist.all_reduce(worst, op=dist.ReduceOp.MAX)
if rank == 0:
    types = sorted({s.sharding_type for m in plan.plan.values() for s in m.values()})
    print(f"torchrec DMP W={world} B={B}/rank D={D} E={E} tables={F} sharding={types}: "
          f"{worst.item() * 1e3:.1f} ms/step, {world * B / worst.item():,.0f} samples/s")
dist.destroy_process_group()
