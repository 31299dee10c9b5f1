"""Helpers of test_grad_sync.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from bert import grad_sync
from bert.config import ModelConfig
from bert.model import BertForPreTraining, pretraining_loss


CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                  max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0, unpad=False)


CAP_MB = 0.01  # ~10 KB buckets: about a dozen for this model


CLIP = 0.05  # below the tiny model's gradient norms: clipping really happens


INF_PARAM = "bert.encoder.layer.1.intermediate.dense.bias"  # rank 0 sets its grad[0] = inf


def global_batch(seed, n=8, s=16):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, s + 1, (n,), generator=g)
    mask = (torch.arange(s)[None, :] < lengths[:, None]).long()
    ids = torch.randint(5, CFG.vocab_size, (n, s), generator=g) * mask
    types = (torch.arange(s)[None, :] >= (lengths[:, None] // 2)).long() * mask
    labels = torch.full((n, s), -100)
    labels[:, 1], labels[:, 3] = ids[:, 1], ids[:, 3]
    nsp = torch.randint(0, 2, (n,), generator=g)
    return dict(input_ids=ids, token_type_ids=types, attention_mask=mask, mlm_labels=labels, nsp_labels=nsp)


def part(batch, i, k):
    return {key: v.chunk(k)[i] for key, v in batch.items()}


def loss_of(model, b, scale=1.0):
    mlm, nsp = model(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"])
    return pretraining_loss(mlm, nsp, b["mlm_labels"], b["nsp_labels"]) * scale


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def fresh_model():
    torch.manual_seed(0)
    return BertForPreTraining(CFG)


def _hook_run(rank, gcfg, steps=2, cap=CAP_MB, scale=None, inject_inf=False):
    """``steps`` backward passes through DDP with the hook (no optimizer: weights fixed), the
    last on batch seed steps-1. Returns the reduced grads and what the hook read from DDP."""
    model = fresh_model()
    ddp = DDP(model, bucket_cap_mb=cap)
    sync = grad_sync.build(gcfg, ddp, model.parameters(), 0.0, (lambda: scale) if scale is not None else None)
    if inject_inf and rank == 0:
        def to_inf(g):
            g = g.clone()
            g[0] = float("inf")
            return g
        dict(model.named_parameters())[INF_PARAM].register_hook(to_inf)
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        loss_of(ddp, part(global_batch(step), rank, 2), 1.0 if scale is None else float(scale)).backward()
    name_of = {p.data_ptr(): n for n, p in model.named_parameters()}
    members = [[name_of[p.data_ptr()] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]
    out = dict(grads=grads(model), members=members)
    if sync.clip is not None:
        out.update(layout=sync.clip.layout, thresholds=sync.clip.thresholds)
    return out


def single_process_grads(seed, clip=0.0):
    """Gradient of the mean loss over the whole global batch, optionally clip_grad_norm_'d."""
    model = fresh_model()
    loss_of(model, global_batch(seed)).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=False)
    return grads(model)


def bucketwise_oracle(locals_, members, thresholds):
    """Clip each rank's bucket to its threshold by its local norm, then average the ranks."""
    out, clipped_norms = {}, []
    for names, t in zip(members, thresholds):
        per_rank = []
        for g in locals_:
            norm = torch.linalg.vector_norm(torch.cat([g[n].flatten() for n in names]))
            coef = min(1.0, t / (norm.item() + grad_sync.EPS))
            clipped_norms.append((norm.item() * coef, t))
            per_rank.append({n: g[n] * coef for n in names})
        for n in names:
            out[n] = sum(r[n] for r in per_rank) / len(per_rank)
    return out, clipped_norms


def assert_grads_close(got, want, **tol):
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], **tol, msg=lambda m, n=n: f"{n}: {m}")
