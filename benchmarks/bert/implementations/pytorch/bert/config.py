"""Every setting of a run, with its default, in one place.

The defaults describe the MLPerf benchmark itself: BERT-Large phase 2 at sequence length
512, closed division, LAMB with the 5.0.0 RCP's hyperparameters for global batch 448
(config_DGXA100_1x8x56x1.sh). Smaller setups (the CPU demo, the
paper's open-division recipe) are overrides, never second copies of a default.

Configuration flows defaults <- optional YAML/JSON file <- dotted ``key.sub=value``
overrides (``python -m bert.train optim.lr=1e-3``). Unknown keys and ill-typed values
raise ``ConfigError`` naming the key; ``validate`` checks the cross-field rules. Each
component receives only its own section (``cfg.model``, ``cfg.optim``, ...).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping


RESOLVED = "resolved"  # section of a dumped config holding facts resolved at run time


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the key."""


@dataclass
class ModelConfig:
    vocab_size: int = 30522  # uncased WordPiece vocab of the benchmark
    hidden_size: int = 1024
    num_layers: int = 24
    num_heads: int = 16
    intermediate_size: int = 4096
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02  # std of the normal init when no checkpoint is given
    # GELU of the feed-forward layers and the MLM head's transform. "gelu_tanh" =
    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the MLCommons reference's (Google's
    # modeling.gelu, what its "hidden_act": "gelu" means): the phase-1 checkpoint was trained
    # with it, and NVIDIA's MLPerf PyTorch code maps "gelu" to it too. "gelu_erf" = x Phi(x),
    # exact: Hugging Face's "gelu". They differ by up to 4.7e-4 an element; docs/model.md says
    # who uses which. A CPU step costs the same either way, within its noise (bench/activation.py,
    # BENCHMARKS.md section 13).
    activation: Literal["gelu_tanh", "gelu_erf"] = "gelu_tanh"
    # Unpadded path: every op but attention runs on [real tokens, hidden] and the MLM head
    # only on masked positions. Off = the padded path, HF's arithmetic (kept as the oracle).
    unpad: bool = True
    # Attention kernel, resolved once at build time: "auto" picks the best available
    # for the device; "sdpa" = torch scaled_dot_product_attention; "math" = explicit
    # softmax(QK^T)V, slow but obviously correct; "flash" = flash-attn's varlen kernel (GPU,
    # needs flash_attn); "torch_varlen" = torch.nn.attention.varlen.varlen_attn (GPU, no
    # attention dropout); "triton" = bert/triton_attention.py, varlen with dropout (GPU,
    # needs triton); "nested" = SDPA on nested jagged tensors (torch's flash kernel with
    # dropout on GPU). auto on GPU: flash, else torch_varlen when attention_dropout is 0,
    # else sdpa; on CPU: sdpa. triton and nested are chosen by name only until a GPU run
    # has checked and timed them (bench/gpu_bert_large.py).
    attention_backend: Literal["auto", "sdpa", "math", "flash", "torch_varlen", "triton", "nested"] = "auto"
    # Packed rows: the batch's sequences packed up to 3 per max_seq_length row (first-fit
    # decreasing), attention within each sequence; the padded layout with less padding.
    # Needs unpad=false.
    pack: bool = False
    # Run each encoder layer through torch.compile (inductor), applied from outside by
    # bert.trainer.build_learner so the module stays plain eager code. Costs compile time at the
    # first steps (and a recompile when a new batch shape appears); off = eager.
    compile_layers: bool = False
    # Q, K and V projected by one [3 * hidden, hidden] GEMM instead of three [hidden, hidden]
    # ones (the input read once, one kernel). The parameters stay HF's query/key/value
    # (names, checkpoints and LAMB's per-tensor trust ratios unchanged), so the result is
    # the unfused one up to float rounding; costs a concatenation of the three weights per
    # forward (3 * hidden^2 floats a layer; under compile_layers inductor fuses it into
    # autocast's cast). On because it is exact and no slower on the CPU (bench/model_levers.py,
    # BENCHMARKS.md); the GPU run's fast_no_fused_qkv case measures it there.
    fused_qkv: bool = True
    # Word-embedding / MLM-decoder rows inside the model padded up to a multiple of this
    # (30,522 -> 30,528 at 64, as NVIDIA pads): whole GEMM tiles and 16-byte aligned rows for
    # the decoder's three GEMMs. The pad rows are zero, never looked up and never trained;
    # the logits are sliced back to vocab_size before the loss and the argmax, and state
    # dicts hold vocab_size rows (checkpoints, HF exports, TF imports): exact (the same loss
    # to the bit in bench/model_levers.py), and no slower on the CPU within its noise; the GPU
    # run's fast_vocab_unpadded case measures it there. 1 = no padding.
    vocab_pad_multiple: int = 64
    # Under autocast (bf16, fp16), the residual stream between sublayers -- the outputs of
    # the embedding's and each sublayer's LayerNorm, which every residual add, dropout and the
    # next LayerNorm read -- in the autocast dtype instead of float32 (autocast runs
    # layer_norm in float32 and returns float32). Halves the bytes of that elementwise work;
    # the normalisation itself stays float32, the residual adds round to the low precision.
    # No effect without autocast (fp32, the CPU's default). Off: tests/unit/test_model.py measures
    # it against Hugging Face's float32 model and the GPU run's fast_autocast_residual case
    # times it (docs/performance.md).
    autocast_residual: bool = False
    # Speed levers of the Triton attention kernel (attention_backend=triton; no effect on the
    # others), off until the GPU run's cases measure them (BENCHMARKS.md section 3, with their
    # estimated gains). The same function either way (tests/unit/test_triton_attention.py).
    # triton_dropout_mask: "philox" = each of the three kernels draws the dropout mask from the
    # saved seed (the forward and both backward kernels: three Philox calls per 8 scores);
    # "bits" = the forward stores its decisions, one bit per score, and both backward kernels
    # read them (costs a uint8 [B, H, max_seqlen, max_seqlen / 8] buffer per layer, kept for the
    # backward: 50 MB a layer at 96 sequences, seq 512, 16 heads).
    triton_dropout_mask: Literal["philox", "bits"] = "philox"
    # triton_fwd_tile: the forward's tile, "64x64" (4 warps) or "128x64" (8 warps: twice the
    # query rows per program, half the K/V reloads, no spill for sm_90). The backward keeps 64x64.
    triton_fwd_tile: Literal["64x64", "128x64"] = "64x64"


@dataclass
class DataConfig:
    train_dir: str = ""  # directory of training hdf5 shards (required)
    eval_dir: str = ""  # directory (or single file) of the eval hdf5 set (required)
    max_seq_length: int = 512
    max_predictions_per_seq: int = 76
    # Read at most this many eval samples (the benchmark uses all 10,000); 0 = all.
    eval_samples: int = 10000
    # Static token budgets (bert/budget.py): pad each training micro-batch's token count
    # (not each sequence) up to one of a few fixed sizes, so a GPU step has one of a few
    # static shapes (CUDA graphs; inductor without dynamic shapes). [] = off (the exact
    # count; "" on the command line); "auto" = a ladder from the local batch, max_seq_length,
    # the sampler and the shipped Wikipedia length histogram; [N, N, ...] ("N,N,..." on the
    # command line) = increasing budgets in tokens. The full grid local_batch_size *
    # max_seq_length is always the top budget, so a batch is padded, never cut. Needs
    # model.unpad=true. Costs the padded tokens' compute (docs/performance.md).
    token_budgets: list[int] | Literal["auto"] = field(default_factory=list)
    # Seconds one shard or eval file may take to read (bert/watchdog.py): past it the run
    # ends (exit 2) naming the file, instead of hanging on a damaged file (HDF5 can spin on a
    # lost sector) or a hung filesystem. Under dist.timeout_s, so the rank that waits says why
    # before its peers time out on it; -1 = two thirds of dist.timeout_s (60 s at its default).
    read_timeout_s: float = -1.0
    # Check every file read against its directory's md5sums.txt, where there is one
    # (bert/integrity.py; written by input_preprocessing's checksum step): one md5 pass over
    # the bytes read, training shards in the prefetch thread beside the steps.
    verify_md5: bool = True


@dataclass
class SamplerConfig:
    # random: each epoch shuffles the shard order and the samples inside each shard,
    # shards dealt round-robin to ranks (closed-division semantics).
    # stratified: every draw unit takes a fixed count per length stratum each step
    # (bert/sampler.py; open division). Other modes read rows by global id.
    mode: Literal["random", "stratified"] = "random"
    # Presorting inside groups of group_size ranks: the group's samples are sorted by
    # length and dealt back (equal counts). snake = the paper's deal; greedy = longest
    # first onto the lightest rank; cost = greedy on L + L^2/(6 hidden). none = no deal.
    deal: Literal["none", "snake", "greedy", "cost"] = "none"
    # Ranks per deal group (a node; capped at the world size); 0 = all ranks (NVIDIA's
    # global exchange padding).
    group_size: int = 8
    # Who takes the strata counts: each rank (counts of local_batch_size) or each group
    # (counts of group_size * local_batch_size: finer rounding; needs a deal).
    draw: Literal["rank", "group"] = "rank"
    # Virtual strata of this many tokens cut from the length index; 0 = the manifest's.
    strata_width: int = 0
    # Samples per stratum per draw unit, e.g. "6,3,2,5"; empty = largest-remainder
    # rounding of the strata's shares.
    counts: list[int] = field(default_factory=list)
    # fixed: the same counts every step (the paper's); carry: each step rounds the running
    # deficit of every stratum, so fine strata keep their exact shares (counts vary a bit).
    rounding: Literal["fixed", "carry"] = "fixed"
    # Where a group learns its samples' lengths: the data pipeline's length index (no
    # exchange) or an all_gather within the group each step (a sync point).
    lengths: Literal["index", "gather"] = "index"


@dataclass
class OptimConfig:
    name: Literal["lamb", "adamw", "adam"] = "lamb"
    lr: float = 4.25e-4  # opt_base_learning_rate (the RCP of global batch 448)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.01  # never applied to biases and LayerNorm parameters
    # Global-norm clipping after the allreduce (closed-division semantics); 0 = off.
    max_grad_norm: float = 1.0
    warmup_steps: int = 0  # opt_learning_rate_warmup_steps
    # Schedule offset: a negative value starts partway through warmup (reference rule).
    start_warmup_step: int = 0
    total_steps: int = 6700  # opt_learning_rate_training_steps: end of the poly decay
    end_lr: float = 0.0  # learning rate reached at total_steps (or lr_max_steps)
    decay_power: float = 1.0  # polynomial decay degree (1 = linear)
    # Where the decay reaches end_lr, when it is not total_steps (the published open recipe's
    # --lr_max_steps: decay ends at 179, the run may go on to 299); 0 = total_steps.
    lr_max_steps: int = 0
    # Warmup + decay formula (bert.optim.lr_at): "mlcommons" = the reference rule, decay
    # progress = step / end (closed division); "published" = the open recipe's published
    # scheduler (Kim et al.): progress = (e - warmup) / (end - warmup), measured from the
    # end of warmup, e its own step count (the rate jumps above lr when warmup ends).
    schedule: Literal["mlcommons", "published"] = "mlcommons"
    # Implementation, resolved once (bert.optim.build_optimizer; the log's
    # opt_implementation says which ran): "auto" takes apex's fused kernels when importable
    # on GPU, else torch's (fused AdamW on GPU, foreach elsewhere) and our foreach LAMB;
    # "apex" requires apex; "torch" is "auto" without apex; "fused" requires torch's fused
    # AdamW (CPU or GPU; there is no torch LAMB); "foreach" never fuses (the on/off baseline);
    # "compiled" (LAMB only) runs our LAMB's update under torch.compile (inductor): a few
    # fused kernels per step instead of ~one per tensor, step count and lr on the device
    # (CUDA-graph capturable), at the price of a compile on the first step (warm-up).
    impl: Literal["auto", "apex", "torch", "fused", "foreach", "compiled"] = "auto"
    # LAMB's bias corrections 1 - b^t in our capturable and compiled LAMB (CUDA graphs,
    # impl=compiled): "tensor" = one per parameter tensor from its own step count (eager or
    # graphed, dividing each moment by its own 0-dim tensor is one kernel per tensor: ~800
    # launches a step for BERT-Large's 398 tensors); "group" = one per parameter group from the
    # group's step count (the most steps any of its tensors took; apex FusedLAMB keeps one
    # count per group): one multi-tensor kernel per moment. The same update while every
    # parameter gets a gradient every step, as in BERT; off until the GPU run measures it.
    lamb_bias_correction: Literal["tensor", "group"] = "tensor"


@dataclass
class PrecisionConfig:
    # Arithmetic of forward and backward, resolved once by bert.precision: "auto" = bf16 on
    # GPU, fp32 on CPU (CPUs without bf16 units emulate it, slower than fp32); "bf16" and
    # "fp16" run the model under torch.autocast (weights, gradients and optimizer state stay
    # fp32: autocast casts per op); "fp16" also scales the loss dynamically (below).
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # Evaluation arithmetic; "train" = whatever training resolved to.
    eval_dtype: Literal["train", "fp32", "bf16", "fp16"] = "train"
    # fp16 dynamic loss scaling (torch.amp.GradScaler): start at loss_scale_init; a step
    # whose gradients hold an inf/nan is skipped (weights untouched, counted and logged)
    # and the scale multiplied by loss_scale_backoff; after loss_scale_growth_interval
    # finite steps in a row it is multiplied by loss_scale_growth. Unused unless fp16.
    loss_scale_init: float = 65536.0  # 2**16, torch's and apex's default
    loss_scale_growth: float = 2.0
    loss_scale_backoff: float = 0.5
    loss_scale_growth_interval: int = 2000
    # FP8 GEMMs in the encoder's linear layers (bert/fp8.py: torchao's float8 training, the
    # master weights, gradients and optimizer staying float32): "tensorwise" = one dynamic
    # scale per tensor (cuBLAS' FP8 GEMM, the fastest), "rowwise" = one per row (more
    # accurate, a slower kernel). Needs torchao and, on CUDA, compute capability >= 8.9 and
    # GEMM shapes on multiples of 16 (unpadded: data.token_budgets); on a CPU torchao's
    # emulation runs (tests). Not with fp16. off = every GEMM in precision.dtype.
    fp8: Literal["off", "tensorwise", "rowwise"] = "off"


@dataclass
class GradSyncConfig:
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size
    # DDP's first bucket (the first gradients backward produces) when smaller than
    # bucket_cap_mb; 0 = bucket_cap_mb (what torch 2.13 does when the cap is given). The published
    # recipe's torch 1.10 always made it 1 MiB (its fp16 gradients: 2 MiB of our fp32 ones).
    # Needs DDP's bucket_cap_mb_list (torch 2.13 has it); older torch: ignored with a note.
    first_bucket_mb: float = 0.0
    # Bucket-wise clipping before the allreduce (open division, Kim et al. 2024): each rank
    # scales each DDP bucket to its threshold as soon as backward fills it, so its allreduce
    # overlaps the rest of backward. 0 = off. Excludes optim.max_grad_norm (never both).
    bucket_clip_norm: float = 0.0
    # Bucket threshold: "count" = bucket_clip_norm / sqrt(number of DDP buckets) (the paper);
    # "size" = bucket_clip_norm * sqrt(bucket numel / total numel). Both bound the norm by it.
    bucket_clip_rule: Literal["count", "size"] = "count"
    # Rule "count" with a fixed B: the threshold is bucket_clip_norm / sqrt(bucket_clip_count)
    # whatever DDP's bucket count is (the published recipe hard-codes 22, the count of its
    # fp16 buckets at 25 MB); 0 = B read from DDP. If DDP makes B' buckets, the norm bound
    # becomes bucket_clip_norm * sqrt(B' / bucket_clip_count).
    bucket_clip_count: int = 0
    # Bucket on the wire: "none" = as is; "fp16"/"bf16" = cast, allreduce, cast back (half
    # the bytes, that dtype's rounding); "powersgd" = rank-r factors of each gradient matrix
    # with error feedback (open division; slow networks; bert/grad_sync.py).
    compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    # Each rank's bucket is multiplied by this before the sum-allreduce; 0 = 1/world size (the
    # mean). The published recipe scaled by a constant: sqrt(22)/4908.98 = 1/1046.6 per rank,
    # 0.978 x the mean at 1,024 ranks (Adam sees it only through epsilon; docs/published_recipe.md).
    reduce_scale: float = 0.0
    # PowerSGD: factor rank r (bytes per n x m matrix: r(n+m) instead of nm) and the number of
    # optimizer steps reduced exactly (plain allreduce) before compressing starts.
    powersgd_rank: int = 4
    powersgd_start_step: int = 1000


@dataclass
class EvalConfig:
    # Evaluate every this many training samples; -1 = the reference rule
    # floor(0.05*(230.23*GBS + 3e6)/25000)*25000. 0 is an error (it would never advance).
    interval_samples: int = -1
    target_accuracy: float = 0.720  # masked-LM accuracy that ends the run
    batch_size: int = 125  # per rank


@dataclass
class DistConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: NCCL on GPU, gloo on CPU
    master_port: int = 29500  # used when neither the launcher nor the env sets one
    # Collective timeout: a rank stuck this long in a collective (a peer died or hangs)
    # fails with an error naming it, instead of hanging the job. Must stay under the 2
    # minutes we promise; raise it only if one rank legitimately works alone longer.
    timeout_s: float = 90.0
    # Rendezvous timeout: how long rank 0 waits for every rank to join at start, and a rank
    # for rank 0's store; separate so the collective timeout can stay short. Under 2 minutes,
    # so a rank that never joins (or cannot reach MASTER_ADDR) ends the job within our
    # promise; raise it where containers start slowly on big jobs (enroot image imports).
    startup_timeout_s: float = 100.0


@dataclass
class CheckpointConfig:
    """Train-state checkpoints (bert/checkpoint.py): everything a run needs to continue exactly."""

    dir: str = ""  # where they are written and looked for; empty = <log.output_dir>/checkpoints
    # Write one every N optimizer steps; 0 = off (timed MLPerf runs: a write stalls training).
    interval_steps: int = 0
    # Write one every M minutes of wall clock (decided at a poll, all ranks agreeing); 0 = off.
    interval_minutes: float = 0.0
    keep: int = 2  # complete checkpoints kept; older ones are deleted after a new one is complete
    # SIGTERM / SIGUSR1 (SLURM --signal=B:USR1@<s>) -> checkpoint at the next poll, exit 3.
    on_signal: bool = True
    # Steps between polls of the signal flag, the minutes clock, failed writes and reads and
    # the NaN streak. Distributed, a poll is one 24-byte all_reduce plus a host sync (ranks
    # must agree to stop at the same step): about 50 us of NCCL latency per poll, so every 10
    # steps costs nothing measurable.
    poll_steps: int = 10
    # auto: continue an unfinished run from the newest complete checkpoint in ``dir``; start
    # fresh over a finished run's (bert/checkpoint.py ``plan``), naming what goes. require
    # (``python -m bert.train --resume``): fail if there is none; continue a finished run only
    # to limits past its end, else refuse naming why. off: start fresh.
    resume: Literal["auto", "require", "off"] = "auto"


@dataclass
class LogConfig:
    # Directory of this run's outputs: MLPerf log, resolved config. Empty = "results".
    output_dir: str = "results"
    log_file: str = "result_0.txt"  # MLPerf log file name inside output_dir
    progress_interval_steps: int = 10  # human progress line (one host sync) every N steps
    # TensorBoard event files of the loop's curves (bert/curves.py, docs/watching.md), written
    # by rank 0 at each progress line and evaluation; empty = off. run.sub sets it under LOGDIR
    # with TENSORBOARD=1, the pretraining scripts always. Needs the [tensorboard] extra; costs
    # one small gather of the ranks' token counts per progress line (BENCHMARKS.md, section 12).
    tensorboard_dir: str = ""
    # One device's peak FLOP/s for the model's arithmetic, the denominator of the MFU curve
    # (e.g. 989e12, an H100 SXM's dense bf16 tensor cores); 0 = unknown: no MFU curve.
    peak_flops_per_s: float = 0.0
    # Which samples each step took: every rank appends one JSON line per optimizer step to
    # DIR/rank_<r>.jsonl, {"step", "rank", "samples": [[shard, row], ...]} (bert/trace.py;
    # docs/watching.md); empty = off. Costs a write per step per rank (BENCHMARKS.md section 17).
    sample_trace: str = ""
    # Also print the MLPerf log's :::MLLOG lines on stdout (they always go to the log file);
    # off, a person sees the progress and eval lines and the verdicts.
    echo_mllog: bool = False
    # submission_org / _platform / _status: set by the launcher (SUBMISSION_ORG,
    # SUBMISSION_PLATFORM, SUBMISSION_STATUS); they must agree with systems/<system>.json
    # (submitter, system_name, status), which tools/package.py checks. The defaults agree
    # with the shipped system files (submitter "reference", status RDI = "research").
    submitter: str = "reference"
    platform: str = ""  # submission_platform; empty = the system name
    system: str = "CPU_1x2"
    status: Literal["onprem", "cloud", "preview", "research"] = "research"
    # Also write what the older rulesets (1.0.0-4.1.0) require beyond 5.0.0, so the same log
    # passes them too: opt_epsilon beside opt_lamb_epsilon, and one weights_initialization
    # event per TensorFlow checkpoint tensor name (398 for BERT-Large; 1.1.0-2.1.0 check the
    # list). Costs ~400 log lines at init, outside the timed region.
    compat: bool = False


@dataclass
class RunConfig:
    division: Literal["closed", "open"] = "closed"
    # mlperf: the benchmark (ends at eval.target_accuracy or the sample limit). pretrain: a
    # from-scratch phase (bert/pretrain.py): no target; MLM and NSP accuracy and loss on the
    # held-out set every eval.interval_samples; ends at its step count; plots the curves.
    mode: Literal["mlperf", "pretrain"] = "mlperf"
    local_batch_size: int = 56  # samples per rank per micro-step
    grad_accum_steps: int = 1
    # Abort (run_stop "aborted") once this many samples were trained without reaching the
    # target; 0 = optim.total_steps * global batch: the schedule's end, past which the rate
    # is optim.end_lr (0 in every closed recipe, so nothing would change). With the RCP
    # recipes that is 1.25x their mean samples to converge and above each reference run.
    max_samples: int = 0
    # Also stop after this many optimizer steps (the published recipe's MAX_STEPS, below its
    # sample cap); 0 = no step limit beyond max_samples.
    max_steps: int = 0
    # -1 = unset: a fresh seed from the OS for every run (rank 0 draws it, every rank uses
    # it; logged as `seed` and written to the dumped config, so the run can be repeated with
    # run.seed=<that value>). MLPerf wants a different seed per run, which the package
    # checker compares; an explicit seed >= 0 is used as given (reproducible runs).
    seed: int = -1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Model weights to start from (empty = random init): a TF checkpoint prefix
    # (model.ckpt-28252), a Hugging Face directory/file, or a file save_checkpoint wrote.
    init_checkpoint: str = ""
    # Write the final model weights here at the end of the run (a state dict with
    # Hugging Face BertForPreTraining names; empty = don't). Not part of the timed run.
    save_checkpoint: str = ""
    # End the run as diverged (run_stop aborted, exit 6) once the loss was NaN/inf for this
    # many consecutive steps on some rank; seen at the checkpoint poll (it rides in the poll's
    # all_reduce: no extra sync), so up to ckpt.poll_steps - 1 steps later. NaN/inf weights
    # or optimizer state end it the same way where a checkpoint or the final weights would
    # be written from them (never written).
    max_nonfinite_steps: int = 20
    # One run per MLPerf log and checkpoint directory: rank 0 locks both for the run's life
    # (bert/runlock.py); a second run there is refused (exit 2) with the holder's host and PID.
    # false only where the filesystem has no locks, and you make sure yourself.
    exclusive: bool = True
    # Whether the launcher dropped the page cache before this run (logged as cache_clear).
    cache_cleared: bool = False
    threads: int = 0  # torch intra-op threads per rank on CPU; 0 = torch's own choice
    # Before run_start: this many full training steps per batch shape on synthetic batches
    # (bert/step_graph.py; no data file is touched), then the model, optimizer, schedule,
    # scaler and RNG put back exactly, so compile, autotuning and graph capture are not timed.
    # Costs that many steps of init time per shape (data.token_budgets rungs); 0 = none.
    warmup_steps: int = 0
    # Replay each training step as CUDA graphs (bert/step_graph.py): one forward+backward
    # graph per batch shape, one for clip + optimizer step; removes the per-kernel launch
    # cost. Needs CUDA, one process, bf16/fp32, data.token_budgets and run.warmup_steps >= 1
    # (each refused otherwise, by name). Costs one capture per shape during the warm-up.
    cuda_graphs: bool = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    grad_sync: GradSyncConfig = field(default_factory=GradSyncConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)


# ---------------------------------------------------------------- launcher variables

# The variables MLPerf's launchers and config_*.sh scripts set (NVIDIA's names), and the key
# each one sets: the one table. run_and_time.sh hands them over with ``python -m bert.train
# --from-env``; tools read a config script through bert/config_script.py. An unset or empty
# variable leaves the default.
LAUNCHER_VARIABLES: dict[str, str] = {
    "DATADIR": "data.train_dir",
    "EVALDIR": "data.eval_dir",
    "INIT_CHECKPOINT": "run.init_checkpoint",
    "SAVE_CHECKPOINT": "run.save_checkpoint",
    "CKPT_DIR": "ckpt.dir",
    "LOGDIR": "log.output_dir",
    "LOGFILE": "log.log_file",
    "TENSORBOARD_DIR": "log.tensorboard_dir",
    "SAMPLE_TRACE": "log.sample_trace",
    "DGXSYSTEM": "log.system",
    "SUBMISSION_ORG": "log.submitter",
    "SUBMISSION_PLATFORM": "log.platform",
    "SUBMISSION_STATUS": "log.status",
    "MLPERF_COMPAT_LOG": "log.compat",
    "DIVISION": "run.division",
    "SEED": "run.seed",
    "BATCHSIZE": "run.local_batch_size",
    "GRADIENT_STEPS": "run.grad_accum_steps",
    "MAX_SAMPLES_TERMINATION": "run.max_samples",
    "CPU_THREADS_PER_RANK": "run.threads",
    "CACHE_CLEARED": "run.cache_cleared",
    "OPTIMIZER": "optim.name",
    "LR": "optim.lr",
    "MAX_STEPS": "optim.total_steps",
    "WARMUP_STEPS": "optim.warmup_steps",
    "START_WARMUP_STEP": "optim.start_warmup_step",
    "OPT_LAMB_BETA_1": "optim.beta1",
    "OPT_LAMB_BETA_2": "optim.beta2",
    "OPT_EPSILON": "optim.eps",
    "WEIGHT_DECAY_RATE": "optim.weight_decay",
    "END_LR": "optim.end_lr",
    "PRECISION": "precision.dtype",
    "EVAL_ITER_SAMPLES": "eval.interval_samples",
    "TARGET_MLM_ACCURACY": "eval.target_accuracy",
}
# The user's further ``key=value`` words (and flags such as --dry-run): no config script sets it.
EXTRA_PARAMS = "EXTRA_PARAMS"
# A config script's own ``key=value`` words, for the keys the table has no variable for.
CONFIG_PARAMS = "CONFIG_PARAMS"
# The config script a shell sourced: each sets it to its own path, so that a launcher or the
# trainer can tell the script's values from what the user set after it (bert/config_script.py).
CONFIG_SCRIPT = "CONFIG_SCRIPT"
# The one precedence, lowest first: the defaults above, a --config file, the config script
# (its variables and CONFIG_PARAMS), the user's environment (the table's variables set over the
# script's) and EXTRA_PARAMS, the command line (whose settings have this origin).
COMMAND_LINE = "command line"


@dataclass(frozen=True)
class Setting:
    """One ``key=value`` and where it came from (a file, a variable, the command line)."""

    key: str
    value: Any
    origin: str


def launcher_settings(variables: Mapping[str, str], script: Mapping[str, str] | None = None,
                      script_name: str = "") -> list[Setting]:
    """The settings a launcher's ``variables`` stand for, lowest precedence first:
    CONFIG_PARAMS' words, each variable of the table that is set and not empty, EXTRA_PARAMS'
    words. ``script``: the variables of the config script the shell sourced (``script_name``),
    as it sets them, which tells a table variable the script set (same value) from one the user
    set over it. Words that are flags (``--dry-run``) belong to the command line, not here."""
    name = script_name or "the config script"
    out = [Setting(k, v, f"{CONFIG_PARAMS} in {name}") for k, v in _words(variables.get(CONFIG_PARAMS, "")).items()]
    for var, key in LAUNCHER_VARIABLES.items():
        value = variables.get(var)
        if value:
            mine = script is not None and script.get(var) == value
            out.append(Setting(key, value, f"{var} in {name}" if mine else f"{var} in the environment"))
    out += [Setting(k, v, EXTRA_PARAMS) for k, v in _words(variables.get(EXTRA_PARAMS, "")).items()]
    return out


def launcher_overrides(variables: Mapping[str, str]) -> dict[str, str]:
    """``launcher_settings`` as plain overrides (the last one of a key wins)."""
    return {s.key: s.value for s in launcher_settings(variables)}


def _words(text: str) -> dict[str, str]:
    return parse_overrides([w for w in text.split() if not w.startswith("--")])


def launcher_variable(key: str) -> str:
    """The launcher variable that sets dotted ``key`` (KeyError: none does)."""
    (var,) = [v for v, k in LAUNCHER_VARIABLES.items() if k == key]
    return var


# ---------------------------------------------------------------- resuming

# What a resume may change (bert/checkpoint.py check_settings): where the files are, how the run
# is checkpointed, logged and connected, its guards (read bound, md5 check, NaN streak, lock,
# threads), none of which changes what a step computes, and when it ends (the target, the
# sample and step limits: read afresh, never from the checkpoint, so a run can be resumed to
# train longer); the new value is applied and logged. Every other setting must be the checkpointed run's: the checkpoint's state would
# silently override some (the optimizer's learning rate, the schedule, the next eval) while
# the log and the dumped config record the new value, and the rest would make the resumed
# run another run than the one the log continues. "section.*" is a whole section.
# data.train_dir / data.eval_dir: the same data under another path (a moved mount); the
# training stream's state records its data's identity (bert/loader.py describe_data), which a
# resume must match. run.seed: the checkpointed run's seed is used (said).
# run.local_batch_size / run.grad_accum_steps / data.token_budgets: how the global batch is split
# among ranks and micro-steps (a resume on another number of ranks); the global batch itself must
# be the checkpoint's (bert/checkpoint.py restore refuses another, naming the splits that keep it).
RESUME_MAY_DIFFER = ("data.train_dir", "data.eval_dir", "data.read_timeout_s", "data.verify_md5", "ckpt.*",
                     "log.*", "dist.*", "run.init_checkpoint", "run.save_checkpoint", "run.seed",
                     "run.max_nonfinite_steps", "run.exclusive", "run.cache_cleared", "run.threads",
                     "eval.target_accuracy", "run.max_samples", "run.max_steps", "run.local_batch_size",
                     "run.grad_accum_steps", "data.token_budgets")

# What a saved config that lacks a key meant by it: the value the code that wrote it ran, where
# that is not today's default. Checkpoints and resolved configs written before model.activation
# existed come from a model that computed the exact erf GELU.
ABSENT_MEANT = {"model.activation": "gelu_erf"}


def may_differ_on_resume(key: str) -> bool:
    return any(key == p or (p.endswith(".*") and key.startswith(p[:-1])) for p in RESUME_MAY_DIFFER)


def resume_changes(saved: Mapping[str, Any], cfg: Config) -> list[str]:
    """The settings of ``cfg`` that differ from ``saved`` (the checkpointed run's config, as
    ``to_dict`` and JSON give it) and may not (RESUME_MAY_DIFFER), each 'key=now (the
    checkpointed run's: then)'. A key ``saved`` lacks (a field added since) compares with what
    its absence meant (``ABSENT_MEANT``), else its default; a key only ``saved`` has (a field
    removed since) is not read by this code."""
    then: dict[str, Any] = {}
    _flatten("", json.loads(json.dumps(to_dict(Config()))), then)  # the defaults, for keys added since
    then.update(ABSENT_MEANT)
    _flatten("", dict(saved), then)
    now: dict[str, Any] = {}
    _flatten("", json.loads(json.dumps(to_dict(cfg))), now)  # tuples as lists, as the saved JSON has them
    return [f"{k}={json.dumps(v)} (the checkpointed run's: {json.dumps(then[k])})"
            for k, v in now.items() if v != then[k] and not may_differ_on_resume(k)]


# ---------------------------------------------------------------- derived quantities


def global_batch_size(cfg: Config, world_size: int) -> int:
    return cfg.run.local_batch_size * cfg.run.grad_accum_steps * world_size


def batch_split(cfg: Config, config_nodes: int, per_node: int, nodes: int) -> tuple[int, int, int]:
    """The config's global batch (run.local_batch_size x run.grad_accum_steps x its
    ``config_nodes`` x ``per_node`` ranks) on ``nodes`` nodes of ``per_node`` ranks: (micro-batch,
    micro-steps, global batch), the fewest micro-steps whose micro-batch is no larger than the
    config's (what is known to fit in memory). Megatron's rule: the global and micro-batch fixed,
    the accumulation derived. ConfigError, naming the node counts that keep it, when the ranks
    do not divide it."""
    gbs = global_batch_size(cfg, config_nodes * per_node)
    ranks = nodes * per_node
    if gbs % ranks:
        fits = [n for n in range(1, 4 * max(nodes, config_nodes) + 1) if gbs % (n * per_node) == 0]
        raise ConfigError(f"the config's global batch {gbs} (run.local_batch_size {cfg.run.local_batch_size} x "
                          f"run.grad_accum_steps {cfg.run.grad_accum_steps} x {config_nodes} node(s) x {per_node}) does "
                          f"not split over {nodes} node(s) x {per_node} = {ranks} ranks; node counts that keep it: "
                          f"{', '.join(map(str, fits)) or 'none'}")
    per_rank = gbs // ranks
    steps = next(a for a in range(1, per_rank + 1) if per_rank % a == 0 and per_rank // a <= cfg.run.local_batch_size)
    return per_rank // steps, steps, gbs


def eval_interval_samples(cfg: Config, world_size: int) -> int:
    """Samples between evaluations: the override, else the reference rule."""
    if cfg.eval.interval_samples != -1:
        return cfg.eval.interval_samples
    gbs = global_batch_size(cfg, world_size)
    return int(math.floor(0.05 * (230.23 * gbs + 3e6) / 25000) * 25000)


def max_samples(cfg: Config, world_size: int) -> int:
    """The sample count that ends a run short of its target (``run_end``)."""
    return run_end(cfg, world_size)[0]


def zero_rate_step(o: OptimConfig) -> int | None:
    """The first update (0-based) from which the schedule's rate stays 0 (bert.optim.lr_at): the
    decay's end when optim.end_lr is 0; None when the rate never reaches 0 for good."""
    if o.end_lr > 0 or o.decay_power <= 0:
        return None
    end = lr_decay_end(o)
    return end - 1 if o.schedule == "published" else end  # published: its own count is the update's + 1


def run_end(cfg: Config, world_size: int) -> tuple[int, list[str]]:
    """The sample count that ends the run short of its target, and what the start of the run
    says about it. A pretraining phase ends at its step count (optim.total_steps), which
    run.max_samples does not change; a benchmark run at run.max_samples (0: the step count);
    either no later than run.max_steps, nor than the update from which the rate stays 0 (no
    step past it changes a weight)."""
    o, r = cfg.optim, cfg.run
    gbs = global_batch_size(cfg, world_size)
    schedule = o.total_steps * gbs
    notes = []
    limits = {"samples": (r.max_samples or schedule) if r.mode == "mlperf" else schedule}
    if r.max_steps:
        limits["steps"] = r.max_steps * gbs
    zero = zero_rate_step(o)
    if zero is not None:
        limits["zero"] = zero * gbs
    end = min(limits.values())
    binding = min(limits, key=lambda k: (limits[k], k == "zero"))  # a tie: the limit that was set says it
    if r.mode == "pretrain" and r.max_samples:
        side = "below" if r.max_samples < schedule else "above" if r.max_samples > schedule else "at"
        notes.append(f"run.max_samples={r.max_samples} ({launcher_variable('run.max_samples')}) is {side} the step "
                     f"count and does not end a pretraining phase: it ends at optim.total_steps={o.total_steps} "
                     f"({schedule} samples); run.max_steps stops it earlier")
    if binding == "samples" and end < schedule:
        notes.append(f"run.max_samples={r.max_samples} ends the run at step {-(-end // gbs)}, before its "
                     f"schedule's end (optim.total_steps={o.total_steps})")
    elif binding == "steps" and end < schedule:
        notes.append(f"run.max_steps={r.max_steps} ends the run before its schedule's end "
                     f"(optim.total_steps={o.total_steps})")
    elif binding == "zero":
        others = min(v for k, v in limits.items() if k != "zero")
        notes.append(f"the rate is 0 from step {zero} (optim.end_lr=0 where the decay ends): the run ends there, "
                     f"after {end} samples, not at {others}")
    if end > schedule:
        notes.append(f"run.max_samples={r.max_samples} trains past the schedule's end (step {o.total_steps}) at "
                     f"the rate optim.end_lr={o.end_lr:g}")
    return end, notes


def start_notes(cfg: Config, world_size: int) -> list[str]:
    """What the start of a run says beyond its settings: how it ends (``run_end``), and for a
    pretraining phase that has fewer positions than a phase 2 would need, that its weights
    cannot start one (phase 2 needs the positions from the first step)."""
    notes = run_end(cfg, world_size)[1]
    m = cfg.model
    if cfg.run.mode == "pretrain" and m.max_position_embeddings < ModelConfig.max_position_embeddings:
        notes.append(f"model.max_position_embeddings={m.max_position_embeddings}: a phase 2 at a longer sequence "
                     f"cannot start from these weights (they must hold its positions, e.g. "
                     f"{ModelConfig.max_position_embeddings}, from phase 1 on)")
    return notes


# The model settings that give the weights their shapes and meaning: a phase that starts from
# another's weights (run.init_checkpoint) must have the same.
WEIGHT_SHAPING = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                  "max_position_embeddings", "type_vocab_size")


def handover_problems(phase1: Config, phase2: Config) -> list[str]:
    """Why phase 2 could not start from phase 1's final weights, each naming the key and both
    values (empty: it can)."""
    return [f"model.{name}: phase 1 has {getattr(phase1.model, name)}, phase 2 needs {getattr(phase2.model, name)}"
            + (f" (data.max_seq_length={phase2.data.max_seq_length})" if name == "max_position_embeddings" else "")
            for name in WEIGHT_SHAPING if getattr(phase1.model, name) != getattr(phase2.model, name)]


def read_timeout_s(cfg: Config) -> float:
    """Seconds a shard or eval file may take to read: data.read_timeout_s, or (-1) two thirds
    of dist.timeout_s."""
    return cfg.data.read_timeout_s if cfg.data.read_timeout_s > 0 else cfg.dist.timeout_s * 2 / 3


# Seconds one shard may take to read in a data-preparation step (``python -m input_preprocessing``,
# its --read-timeout-s): the watchdog's bound there, as data.read_timeout_s is a run's. Those
# steps read bigger files than a run's shards (a part of create's output holds ~160,000 samples,
# ~370 MB in the fixed layout, for MLPerf's text), each in seconds: past ten minutes the file
# or its filesystem is stuck, not slow.
PREP_READ_TIMEOUT_S = 600.0


def padded_vocab_size(m: ModelConfig) -> int:
    """Rows of the model's word embedding and MLM decoder: vocab_size rounded up to a
    multiple of model.vocab_pad_multiple."""
    return -(-m.vocab_size // m.vocab_pad_multiple) * m.vocab_pad_multiple


def lr_decay_end(o: OptimConfig) -> int:
    """The step at which the learning-rate decay reaches ``end_lr``."""
    return o.lr_max_steps if o.lr_max_steps > 0 else o.total_steps


def is_benchmark_model(cfg: Config) -> bool:
    """BERT-Large at sequence length 512: the model the RCPs and the closed rules describe."""
    return (cfg.model.hidden_size, cfg.model.num_layers, cfg.data.max_seq_length) == (1024, 24, 512)


def timed_run_problems(cfg: Config) -> list[str]:
    """What a timed closed-division BERT-Large run needs beyond ``validate`` (which also
    passes the pieces tests and dry runs build): each problem names the key and what to set."""
    if cfg.run.division != "closed" or not is_benchmark_model(cfg):
        return []
    out = []
    if not cfg.run.init_checkpoint:
        out.append("run.init_checkpoint: a closed BERT-Large run starts from the phase-1 checkpoint "
                   "(model.ckpt-28252): set INIT_CHECKPOINT (run.init_checkpoint)")
    if cfg.data.eval_samples not in (0, 10000):
        out.append(f"data.eval_samples={cfg.data.eval_samples}: a closed BERT-Large run evaluates on the full "
                   "10,000-sample eval set: set data.eval_samples=10000 (or 0 = all)")
    return out


# ---------------------------------------------------------------- building and checking


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Convert ``value`` (a string from the command line, or a parsed file value) to ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # e.g. list[int] | Literal["auto"]: the first arm that takes it
        for arm in typing.get_args(tp):
            try:
                return _coerce(key, arm, value)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {' or '.join(map(_describe, typing.get_args(tp)))}, got {value!r}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):  # "1,2,3" from the command line; "" = the empty list
            value = [v.strip() for v in value.split(",")] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list (N,N,... on the command line), got {value!r}")
        return [_coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value)]
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected a boolean, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                as_float = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
            if as_float.is_integer() and math.isfinite(as_float):
                return int(as_float)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if not math.isfinite(out):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return out
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{key}: unsupported field type {tp!r}")  # a bug in this file


def _describe(tp: Any) -> str:
    """What a value of ``tp`` looks like, for an error message."""
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(c) for c in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_describe(typing.get_args(tp)[0]).removeprefix('an ').removeprefix('a ')}s (N,N,...)"
    return {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}.get(tp, repr(tp))


def _field_types(obj: Any) -> dict[str, Any]:
    return typing.get_type_hints(type(obj))


def _set(cfg: Config, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node: Any = cfg
    for i, name in enumerate(parts):
        path = ".".join(parts[: i + 1])
        if not dataclasses.is_dataclass(node):
            raise ConfigError(f"unknown config key {dotted!r} ({'.'.join(parts[:i])} has no sub-keys)")
        types = _field_types(node)
        if name not in types:
            known = ", ".join(sorted(types))
            raise ConfigError(f"unknown config key {path!r} (known here: {known})")
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(node, name)):
                raise ConfigError(f"{path}: is a section; set one of its keys instead")
            setattr(node, name, _coerce(path, types[name], value))
        else:
            node = getattr(node, name)


def _flatten(prefix: str, tree: Any, out: dict[str, Any]) -> None:
    if isinstance(tree, dict):
        for k, v in tree.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = tree


def load_file(path: str | Path) -> dict[str, Any]:
    """Flat {dotted key: value} from a YAML or JSON file of nested sections."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"config file {p}: {e.strerror}") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml  # safe_load: configuration is data, never code

            tree = yaml.safe_load(text) or {}
        else:
            tree = json.loads(text)
    except Exception as e:  # noqa: BLE001 - report any parse failure with the file name
        raise ConfigError(f"config file {p}: cannot parse: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping of sections")
    # "resolved" holds run-time facts written by dumps(); a dumped config reloads as is.
    tree.pop(RESOLVED, None)
    flat: dict[str, Any] = {}
    _flatten("", tree, flat)
    return flat


def parse_overrides(args: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {arg!r} is not of the form key.sub=value")
        out[key.strip()] = value
    return out


def build_config(overrides: dict[str, Any] | None = None, config_file: str | None = None) -> Config:
    """Defaults <- file <- overrides, then ``validate``."""
    settings = [Setting(k, v, COMMAND_LINE) for k, v in (overrides or {}).items()]
    return resolve(settings, config_file)[0]


def resolve(settings: list[Setting], config_file: str | None = None) -> tuple[Config, dict[str, str]]:
    """Defaults <- ``config_file`` <- ``settings`` in their order (a later one of a key wins),
    then ``validate``; and where each key that was set came from (its last setting's origin)."""
    cfg = Config()
    origins: dict[str, str] = {}
    if config_file:
        settings = [Setting(k, v, str(config_file)) for k, v in load_file(config_file).items()] + list(settings)
    for s in settings:
        _set(cfg, s.key, s.value)
        origins[s.key] = s.origin
    validate(cfg)
    return cfg, origins


def origin_lines(cfg: Config, origins: Mapping[str, str]) -> list[str]:
    """One line per setting of ``cfg`` that is not its default: ``key=value (origin)``, in the
    sections' order; the start of a run prints them."""
    now: dict[str, Any] = {}
    _flatten("", json.loads(json.dumps(to_dict(cfg))), now)
    default: dict[str, Any] = {}
    _flatten("", json.loads(json.dumps(to_dict(Config()))), default)
    return [f"{k}={json.dumps(v)} ({origins.get(k, 'origin unknown')})" for k, v in now.items() if v != default[k]]


def parse_budgets(spec: list[int] | Literal["auto"], local_batch: int, max_seq_length: int) -> tuple[int, ...] | None:
    """``data.token_budgets`` -> None (off, or "auto": the ladder decides), or the explicit
    rungs with the full grid appended when the list stops short of it. Raises ConfigError
    naming the key."""
    if spec == "auto" or not spec:
        return None
    full = local_batch * max_seq_length
    rungs = list(spec)
    if any(r < 1 for r in rungs):
        raise ConfigError(f"data.token_budgets={spec!r}: every budget must be >= 1 token")
    if any(b <= a for a, b in zip(rungs, rungs[1:])):
        raise ConfigError(f"data.token_budgets={spec!r}: budgets must be strictly increasing")
    if rungs[-1] > full:
        raise ConfigError(f"data.token_budgets={spec!r}: {rungs[-1]} exceeds the full grid run.local_batch_size "
                          f"x data.max_seq_length = {full}, which is always the top budget")
    # A batch above every listed budget goes to the full grid: padded, never cut.
    return tuple(rungs) if rungs[-1] == full else (*rungs, full)


def validate(cfg: Config) -> None:
    """Cross-field rules; each failure names the key."""
    m = cfg.model

    def need(cond: bool, key: str, why: str) -> None:
        if not cond:
            raise ConfigError(f"{key}: {why}")

    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                 "max_position_embeddings", "type_vocab_size"):
        need(getattr(m, name) > 0, f"model.{name}", "must be positive")
    need(m.hidden_size % m.num_heads == 0, "model.hidden_size",
         f"{m.hidden_size} is not divisible by model.num_heads={m.num_heads}")
    for name in ("hidden_dropout", "attention_dropout"):
        need(0.0 <= getattr(m, name) < 1.0, f"model.{name}", "must be in [0, 1)")
    need(not (m.pack and m.unpad), "model.pack", "packed rows need model.unpad=false")
    need(m.vocab_pad_multiple > 0, "model.vocab_pad_multiple", "must be positive (1 = no padding)")
    d = cfg.data
    need(0 < d.max_seq_length <= m.max_position_embeddings, "data.max_seq_length",
         f"must be in [1, model.max_position_embeddings={m.max_position_embeddings}]")
    need(0 < d.max_predictions_per_seq <= d.max_seq_length, "data.max_predictions_per_seq",
         "must be in [1, data.max_seq_length]")
    need(d.eval_samples >= 0, "data.eval_samples", "must be >= 0")
    need(d.read_timeout_s == -1 or 0 < d.read_timeout_s < cfg.dist.timeout_s, "data.read_timeout_s",
         f"must be positive and under dist.timeout_s={cfg.dist.timeout_s:g} (else a rank's peers time out "
         "on it before it can say which file hangs), or -1 for two thirds of it")
    if d.token_budgets:  # budgets pad the unpadded layout (bert/budget.py)
        if not m.unpad or m.pack:
            raise ConfigError(f"data.token_budgets={d.token_budgets!r}: budgets pad the unpadded layout; they "
                              "need model.unpad=true and model.pack=false")
        if cfg.run.local_batch_size > 0:  # else the run.local_batch_size rule names it
            parse_budgets(d.token_budgets, cfg.run.local_batch_size, d.max_seq_length)
    o = cfg.optim
    need(o.lr > 0, "optim.lr", "must be positive")
    need(0 <= o.beta1 < 1, "optim.beta1", "must be in [0, 1)")
    need(0 <= o.beta2 < 1, "optim.beta2", "must be in [0, 1)")
    need(o.eps > 0, "optim.eps", "must be positive")
    need(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    need(o.max_grad_norm >= 0, "optim.max_grad_norm", "must be >= 0 (0 = off)")
    need(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    need(o.total_steps > 0, "optim.total_steps", "must be positive")
    need(o.end_lr >= 0, "optim.end_lr", "must be >= 0")
    need(o.lr_max_steps >= 0, "optim.lr_max_steps", "must be >= 0 (0 = optim.total_steps)")
    need(o.schedule != "published" or lr_decay_end(o) > o.warmup_steps, "optim.schedule",
         "the published schedule decays over (lr_max_steps or total_steps) - warmup_steps steps: "
         "needs more steps than optim.warmup_steps")
    need(zero_rate_step(o) != 0, "optim.lr_max_steps", "the schedule's rate is 0 from the first update: nothing would train")
    need(o.schedule == "mlcommons" or cfg.run.division == "open", "optim.schedule",
         "the closed division follows the reference schedule (mlcommons)")
    pr = cfg.precision
    need(pr.loss_scale_init > 0, "precision.loss_scale_init", "must be positive")
    need(pr.loss_scale_growth > 1, "precision.loss_scale_growth", "must be > 1")
    need(0 < pr.loss_scale_backoff < 1, "precision.loss_scale_backoff", "must be in (0, 1)")
    need(pr.loss_scale_growth_interval > 0, "precision.loss_scale_growth_interval", "must be positive")
    check_optim_impl(o)
    g = cfg.grad_sync
    need(g.bucket_cap_mb > 0, "grad_sync.bucket_cap_mb", "must be positive")
    need(0 <= g.first_bucket_mb <= g.bucket_cap_mb, "grad_sync.first_bucket_mb",
         "must be in [0, grad_sync.bucket_cap_mb] (0 = bucket_cap_mb)")
    need(g.bucket_clip_norm >= 0, "grad_sync.bucket_clip_norm", "must be >= 0 (0 = off)")
    need(not (g.bucket_clip_norm > 0 and o.max_grad_norm > 0), "grad_sync.bucket_clip_norm",
         "bucket-wise clipping and optim.max_grad_norm (global clipping) exclude each other: set one to 0")
    need(not (g.bucket_clip_norm > 0 and cfg.run.division == "closed"), "grad_sync.bucket_clip_norm",
         "the closed division clips on the global norm after allreduce (optim.max_grad_norm)")
    need(g.reduce_scale >= 0, "grad_sync.reduce_scale", "must be >= 0 (0 = the mean)")
    need(g.reduce_scale == 0 or (cfg.run.division == "open" and g.compression != "powersgd"),
         "grad_sync.reduce_scale", "a constant reduction scale is for the open division, without powersgd")
    need(g.bucket_clip_count >= 0, "grad_sync.bucket_clip_count", "must be >= 0 (0 = DDP's bucket count)")
    need(g.bucket_clip_count == 0 or g.bucket_clip_rule == "count", "grad_sync.bucket_clip_count",
         "a fixed bucket count applies to bucket_clip_rule=count only")
    need(g.powersgd_rank > 0, "grad_sync.powersgd_rank", "must be positive")
    # torch's hook needs one exact step before error feedback and warm start begin.
    need(g.powersgd_start_step >= 2, "grad_sync.powersgd_start_step", "must be >= 2")
    need(not (g.compression == "powersgd" and cfg.run.division == "closed"), "grad_sync.compression",
         "powersgd changes the gradient (low-rank, error feedback): open division only")
    # An inf/nan bucket would enter the error-feedback residual and poison every later step.
    need(not (g.compression == "powersgd" and pr.dtype == "fp16"), "grad_sync.compression",
         "powersgd with precision.dtype=fp16: an overflowing step would leave inf in the "
         "error-feedback residual forever; use bf16 or fp32")
    e = cfg.eval
    need(e.interval_samples > 0 or e.interval_samples == -1, "eval.interval_samples",
         f"{e.interval_samples} is not a number of samples (> 0), nor -1 for the reference rule")
    need(0 < e.target_accuracy <= 1, "eval.target_accuracy", "must be in (0, 1]")
    need(e.batch_size > 0, "eval.batch_size", "must be positive")
    need(cfg.dist.timeout_s > 0, "dist.timeout_s", "must be positive")
    need(cfg.dist.startup_timeout_s > 0, "dist.startup_timeout_s", "must be positive")
    need(0 < cfg.dist.master_port < 65536, "dist.master_port", "must be a TCP port")
    need(cfg.log.progress_interval_steps > 0, "log.progress_interval_steps", "must be positive")
    need(cfg.log.peak_flops_per_s >= 0, "log.peak_flops_per_s", "must be >= 0 (0 = unknown)")
    need(bool(cfg.log.output_dir), "log.output_dir", "must not be empty")
    sm = cfg.sampler
    need(sm.group_size >= 0, "sampler.group_size", "must be >= 0 (0 = all ranks)")
    need(sm.strata_width >= 0, "sampler.strata_width", "must be >= 0 (0 = the manifest's strata)")
    need(sm.draw == "rank" or sm.deal != "none", "sampler.draw", "draw=group needs a sampler.deal")
    need(sm.lengths == "index" or (sm.deal != "none" and sm.draw == "rank"), "sampler.lengths",
         "gather needs a sampler.deal and sampler.draw=rank")
    need(cfg.run.division == "open" or (sm.mode == "random" and sm.deal == "none"), "sampler.mode",
         "the closed division samples uniformly at random (mode=random, deal=none)")
    r = cfg.run
    need(r.local_batch_size > 0, "run.local_batch_size", "must be positive")
    need(r.grad_accum_steps > 0, "run.grad_accum_steps", "must be positive")
    need(r.max_samples >= 0, "run.max_samples", "must be >= 0")
    need(r.max_steps >= 0, "run.max_steps", "must be >= 0 (0 = no step limit)")
    need(r.seed >= -1, "run.seed", "must be >= 0, or -1 for a fresh seed from the OS")
    need(r.threads >= 0, "run.threads", "must be >= 0")
    need(r.warmup_steps >= 0, "run.warmup_steps", "must be >= 0 (0 = no warm-up)")
    need(not (r.warmup_steps and cfg.grad_sync.compression == "powersgd"), "run.warmup_steps",
         "a warm-up with grad_sync.compression=powersgd would start its error feedback and warm "
         "start on synthetic gradients: use run.warmup_steps=0")
    need(r.max_nonfinite_steps > 0, "run.max_nonfinite_steps", "must be positive")
    k = cfg.ckpt
    need(k.interval_steps >= 0, "ckpt.interval_steps", "must be >= 0 (0 = off)")
    need(k.interval_minutes >= 0, "ckpt.interval_minutes", "must be >= 0 (0 = off)")
    need(k.keep > 0, "ckpt.keep", "must be positive")
    need(k.poll_steps > 0, "ckpt.poll_steps", "must be positive")


def check_optim_impl(o: OptimConfig) -> None:
    """What ``optim.impl`` cannot give ``optim.name`` (validate; bert.optim.build_optimizer for
    an OptimConfig built by hand)."""
    if o.impl == "fused" and o.name == "lamb":
        raise ConfigError("optim.impl: 'fused' is torch's fused AdamW; torch has no LAMB "
                          "(use auto, apex, compiled or foreach)")
    if o.impl == "compiled" and o.name != "lamb":
        raise ConfigError("optim.impl: 'compiled' is LAMB's; AdamW's best is torch's fused kernel "
                          "(use auto, torch or fused)")


# ---------------------------------------------------------------- rules of a device and a world size

FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper and later
FP8_ALIGN = 16  # torch._scaled_mm: both dimensions of the second operand are multiples of 16


def check_for_device(cfg: Config, device_type: str, world_size: int,
                     capability: Callable[[], tuple[int, int]] | None = None) -> None:
    """What this device and world size cannot run, refused naming the key (the trainer calls
    it at build time, when both are known): CUDA graphs, FP8 GEMMs. ``capability`` gives the
    CUDA device's compute capability (a parameter, so tests can stand in for a GPU)."""
    check_cuda_graphs(cfg, device_type, world_size)
    check_fp8(cfg, device_type, capability)


def check_cuda_graphs(cfg: Config, device_type: str, world_size: int) -> None:
    """What graph capture cannot do (bert/step_graph.py)."""
    if not cfg.run.cuda_graphs:
        return
    why = None
    if device_type != "cuda":
        why = f"needs a CUDA device (device is {device_type!r})"
    elif world_size > 1:
        why = f"captures a single process's step; this run has {world_size} ranks (DDP's allreduce is not captured)"
    elif cfg.precision.dtype == "fp16":
        why = "fp16's loss scaler syncs the host to skip overflowing steps: use precision.dtype=bf16"
    elif cfg.optim.impl == "apex":
        why = "apex's fused optimizers are not capturable: use optim.impl=compiled or torch"
    elif not cfg.data.token_budgets:
        why = "needs static batch shapes: set data.token_budgets (e.g. auto)"
    elif cfg.run.warmup_steps < 1:
        why = "needs run.warmup_steps >= 1 (the optimizer state must exist before capture)"
    if why:
        raise ConfigError(f"run.cuda_graphs: {why}")


def check_fp8(cfg: Config, device_type: str, capability: Callable[[], tuple[int, int]] | None = None) -> None:
    """What FP8 GEMMs cannot do (bert/fp8.py)."""
    recipe = cfg.precision.fp8
    if recipe == "off":
        return
    key = f"precision.fp8={recipe}"
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"{key}: needs torchao (pip install the version pinned in constraints.txt, "
                          "or the package's [fp8] extra)")
    if cfg.precision.dtype == "fp16":
        raise ConfigError(f"{key}: not with precision.dtype=fp16 (untested here; torchao's float8 recipes "
                          "run their high-precision parts in bf16): use precision.dtype=bf16")
    if device_type != "cuda":
        return  # torchao's emulation: no tensor-core shape rules
    if capability is None:
        raise ConfigError(f"{key}: the CUDA device's compute capability is unknown")
    cc = capability()
    if tuple(cc) < FP8_MIN_CAPABILITY:
        raise ConfigError(f"{key}: needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or later); "
                          f"this GPU has {cc[0]}.{cc[1]}")
    m, d, r = cfg.model, cfg.data, cfg.run
    for name in ("hidden_size", "intermediate_size"):
        if getattr(m, name) % FP8_ALIGN:
            raise ConfigError(f"{key}: model.{name}={getattr(m, name)} is not a multiple of {FP8_ALIGN} "
                              "(torch._scaled_mm's rule for GEMM dimensions)")
    if not m.unpad:  # padded or packed rows: batch (or rows) x max_seq_length tokens
        if d.max_seq_length % FP8_ALIGN:
            raise ConfigError(f"{key}: data.max_seq_length={d.max_seq_length} is not a multiple of {FP8_ALIGN}: "
                              "the token rows are the inner dimension of the FP8 weight-gradient GEMM")
        return
    if not d.token_budgets:
        raise ConfigError(f"{key}: the unpadded layout's token count is the inner dimension of the FP8 "
                          f"weight-gradient GEMM and must be a multiple of {FP8_ALIGN}: set data.token_budgets "
                          "(auto places its rungs on multiples of 64)")
    full = r.local_batch_size * d.max_seq_length
    rungs = parse_budgets(d.token_budgets, r.local_batch_size, d.max_seq_length) or (full,)  # auto: 64s + full
    odd = [t for t in rungs if t % FP8_ALIGN]
    if odd:
        raise ConfigError(f"{key}: data.token_budgets rungs {odd} are not multiples of {FP8_ALIGN} (the inner "
                          "dimension of the FP8 weight-gradient GEMM)")


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dumps(cfg: Config, extra: dict[str, Any] | None = None) -> str:
    """The resolved config (plus facts resolved at run time) as JSON: what --config reads."""
    tree = to_dict(cfg)
    if extra:
        tree[RESOLVED] = extra
    return json.dumps(tree, indent=2, sort_keys=True) + "\n"
