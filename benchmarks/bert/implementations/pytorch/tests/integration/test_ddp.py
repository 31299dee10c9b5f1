"""2 gloo ranks: the gradients DDP leaves after its allreduce equal one process's gradients
on the same global batch (the mean of the two halves' losses, which is what DDP averages)."""


import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bert.config import ModelConfig
from bert.model import BertForPreTraining, pretraining_loss
from conftest import end_worker, free_port

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                  max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0, unpad=False)


def global_batch(seed=0, n=8, s=16):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, s + 1, (n,), generator=g)
    mask = (torch.arange(s)[None, :] < lengths[:, None]).long()
    ids = torch.randint(5, CFG.vocab_size, (n, s), generator=g) * mask
    types = (torch.arange(s)[None, :] >= (lengths[:, None] // 2)).long() * mask
    labels = torch.full((n, s), -100)
    labels[:, 1] = ids[:, 1]
    labels[:, 3] = ids[:, 3]
    nsp = torch.randint(0, 2, (n,), generator=g)
    return ids, types, mask, labels, nsp


def loss_of(model, ids, types, mask, labels, nsp):
    mlm, nsp_logits = model(input_ids=ids, token_type_ids=types, attention_mask=mask)
    return pretraining_loss(mlm, nsp_logits, labels, nsp)


def _worker(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = BertForPreTraining(CFG)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
    half = [t.chunk(2)[rank] for t in global_batch()]
    loss_of(ddp, *half).backward()
    if rank == 0:
        torch.save({n: p.grad.clone() for n, p in model.named_parameters()}, out)
    end_worker()


def test_two_rank_gradients_equal_single_process(tmp_path):
    out = str(tmp_path / "grads.pt")
    mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
    ddp_grads = torch.load(out, weights_only=True)

    torch.manual_seed(0)
    model = BertForPreTraining(CFG)
    halves = list(zip(*[t.chunk(2) for t in global_batch()]))
    loss = sum(loss_of(model, *h) for h in halves) / 2
    loss.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(ddp_grads[n], p.grad, atol=1e-6, rtol=1e-5), n
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())
