"""bert.evaluate.mlm_accuracy, the number that ends a run, on 2 gloo ranks: masked-LM accuracy over
the whole eval set when the ranks hold different numbers of batches, the batches different
numbers of samples, and the samples different numbers of masked positions.

The oracle is the count the test designed, not a second run of the same arithmetic: each
labelled position gets the model's own (clear) top prediction as its label, or a token the
model ranks last, so the correct and labelled counts of every batch are chosen before the
ranks run. The accuracy is then sum(correct) / sum(labelled) over all batches of both ranks;
the mean of the batch accuracies, the mean of the two ranks' accuracies, or a division by
samples instead of positions each give another number on these batches.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bert.evaluate import held_out_metrics, mlm_accuracy
from bert.config import ModelConfig
from bert.model import BertForPreTraining
from conftest import end_worker, free_port

# Dropout on: evaluate must switch it off (model.eval()) for the designed labels to hold.
CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                  max_position_embeddings=32, hidden_dropout=0.1, attention_dropout=0.1, unpad=False)
S = 16
MARGIN = 1e-3  # a label is only the top prediction where it leads the runner-up by this much
# Per rank, per batch: (samples, labelled positions, of which correct).
PLAN = [[(3, 4, 4), (5, 20, 5)],
        [(2, 2, 0), (6, 30, 27), (1, 1, 1)]]


def model() -> BertForPreTraining:
    torch.manual_seed(0)
    return BertForPreTraining(CFG)


def designed_batches(m: BertForPreTraining) -> list[list[dict]]:
    """PLAN's batches: inputs at random, then labels from ``m``'s eval-mode predictions."""
    g = torch.Generator().manual_seed(1)
    m.eval()
    out = []
    for rank_plan in PLAN:
        out.append([])
        for n, labelled, correct in rank_plan:
            lengths = torch.randint(S // 2, S + 1, (n,), generator=g)
            mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
            ids = torch.randint(5, CFG.vocab_size, (n, S), generator=g) * mask
            types = (torch.arange(S)[None, :] >= (lengths[:, None] // 2)).long() * mask
            with torch.no_grad():
                logits, _ = m(input_ids=ids, token_type_ids=types, attention_mask=mask)
            top2 = logits.topk(2, dim=-1)
            clear = (top2.values[..., 0] - top2.values[..., 1] > MARGIN) & mask.bool()
            clear[:, 0] = False  # [CLS] is never a prediction
            # The labelled positions, dealt over the samples in turn (unequal counts per sample).
            slots = [[j for j in range(S) if clear[b, j]] for b in range(n)]
            chosen = []
            while len(chosen) < labelled:
                b = len(chosen) % n
                assert slots[b], "the plan asks for more clear positions than a sample has"
                chosen.append((b, slots[b].pop(0)))
            labels = torch.full((n, S), -100)
            for i, (b, j) in enumerate(chosen):
                labels[b, j] = top2.indices[b, j, 0] if i < correct else logits[b, j].argmin()
            out[-1].append(dict(input_ids=ids, token_type_ids=types, attention_mask=mask, mlm_labels=labels,
                                nsp_labels=torch.zeros(n, dtype=torch.long)))
    return out


def _worker(rank, port, path, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    saved = torch.load(path, weights_only=True)
    m = BertForPreTraining(CFG)
    m.load_state_dict(saved["model"])
    m.train()
    acc = mlm_accuracy(m, saved["batches"][rank], torch.device("cpu"))
    # Ctrl-C on rank 1 after its first batch, none on rank 0: both learn it from the sum.
    calls = itertools.count()
    stopped = mlm_accuracy(m, saved["batches"][rank], torch.device("cpu"),
                           interrupted=lambda: rank == 1 and next(calls) >= 1)
    torch.save({"accuracy": acc, "training": m.training, "interrupted": stopped}, f"{out_dir}/rank{rank}.pt")
    end_worker()


def test_accuracy_is_sum_of_correct_over_sum_of_labelled_across_batches_and_ranks(tmp_path):
    m = model()
    batches = designed_batches(m)
    correct = sum(c for rank_plan in PLAN for _, _, c in rank_plan)
    labelled = sum(n for rank_plan in PLAN for _, n, _ in rank_plan)
    want = correct / labelled  # 37 / 57
    # The wrong answers this data tells apart from the right one.
    batch_accs = [Fraction(c, n) for rank_plan in PLAN for _, n, c in rank_plan]
    mean_of_batches = float(sum(batch_accs) / len(batch_accs))
    rank_accs = [Fraction(sum(c for *_, c in rp), sum(n for _, n, _ in rp)) for rp in PLAN]
    mean_of_ranks = float(sum(rank_accs) / 2)
    per_sample = correct / sum(s for rank_plan in PLAN for s, _, _ in rank_plan)
    assert len({want, mean_of_batches, mean_of_ranks, per_sample, float(rank_accs[0])}) == 5

    torch.save({"model": m.state_dict(), "batches": batches}, tmp_path / "eval.pt")
    mp.spawn(_worker, args=(free_port(), str(tmp_path / "eval.pt"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["accuracy"] == want, (rank, got["accuracy"], want, dict(
            mean_of_batches=mean_of_batches, mean_of_ranks=mean_of_ranks, per_sample=per_sample))
        assert got["training"], "evaluate must give the model back in training mode"
        assert got["interrupted"] is None, rank

    # One process holding every batch (no process group: the sum is its own) agrees.
    m.train()
    assert mlm_accuracy(m, [b for rank_batches in batches for b in rank_batches], torch.device("cpu")) == want
    assert m.training
    # The pretraining mode's evaluation stops the same way.
    assert held_out_metrics(m, batches[0], torch.device("cpu"), interrupted=lambda: True) is None and m.training
    assert held_out_metrics(m, batches[0], torch.device("cpu"))["mlm_accuracy"] == 9 / 24
