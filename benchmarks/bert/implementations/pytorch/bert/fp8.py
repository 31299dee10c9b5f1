"""FP8 GEMMs for the encoder's linear layers (``precision.fp8``), applied from outside the model.

torchao's float8 training (``torchao.float8.convert_to_float8_training``, pure Python over
``torch._scaled_mm``; pinned in constraints.txt) swaps each chosen ``nn.Linear`` for its
``Float8Linear``: the same parameter objects, so names, state dicts, checkpoints, DDP and
the optimizer see no change. Its forward and both backward GEMMs cast their operands to FP8
with scales computed on the device from each operand's absolute maximum (dynamic scaling:
no host sync, so CUDA-graph safe) and multiply with FP8 tensor cores. Master weights,
gradients and optimizer state stay float32; every other op (attention, LayerNorm, GELU, the
heads) runs in ``precision.dtype`` as before. The recipes are torchao's:

- ``tensorwise``: one scale per tensor (e4m3 inputs and weights, e5m2 output gradients),
  cuBLAS' FP8 GEMM: the fastest;
- ``rowwise``: one scale per row (e4m3 throughout, power-of-2 scales): more accurate near
  outliers, a slower GEMM kernel.

Converted: every linear of the encoder (Q, K, V -- or the fused QKV GEMM, which runs
through the query module -- the attention output, FFN in and out): 93% of a BERT-Large
training step's useful FLOPs at seq 512 on Wikipedia lengths (bench/flops.py). Not
converted: the pooler (one row per sequence) and the MLM head (masked rows only; its decoder
is the tied word embedding), which keep the logits at ``precision.dtype``.

On a CPU, torchao's emulation runs instead (``emulate=True``: the same casts and scales,
the GEMM on the dequantised operands in high precision): for tests, slower than fp32.

What cannot work is refused at build time (``bert.config.check_fp8``), naming the key: no torchao; a GPU
without FP8 tensor cores (compute capability < 8.9); GEMM dimensions that are not multiples
of 16 (``torch._scaled_mm``'s rule: the hidden and intermediate sizes, and the token rows,
which are the inner dimension of the weight-gradient GEMM -- so the unpadded layout needs
``data.token_budgets`` with rungs on multiples of 16: ``auto`` places them on multiples of
64); and ``precision.dtype=fp16``, untested here (torchao's recipes are bf16's; per-tensor
dynamic scaling already does what fp16's loss scaler is for). With ``model.compile_layers``
inductor fuses the casts and scale computations into neighbouring kernels; eager they are
separate kernels per GEMM operand (correct, slower). ``run.cuda_graphs`` captures it as is.
Evaluation runs the forward GEMMs in FP8 too.

torchao 0.18's conversion also patches inductor's Triton min/max code generation
process-wide (torchao/float8/_inductor_patch.py: an equivalent ``tl.where`` form that
avoids a Triton FP8 store miscompile): numerically identical, and only in processes that
convert a model.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn




def encoder_linears(module: nn.Module, fqn: str) -> bool:
    """torchao's module filter: the ``nn.Linear`` layers under ``bert.encoder``."""
    return isinstance(module, nn.Linear) and fqn.startswith("bert.encoder.")


def convert(model: nn.Module, recipe: str, device_type: str) -> nn.Module:
    """``model`` with its encoder's linears swapped in place for torchao's ``Float8Linear``
    (``recipe`` "tensorwise" or "rowwise"; emulated off CUDA). Call
    ``bert.config.check_fp8`` first, and this before torch.compile and DDP wrap the modules."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # optional dependency

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=device_type != "cuda")
    return convert_to_float8_training(model, config=config, module_filter_fn=encoder_linears)
