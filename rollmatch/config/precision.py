"""Training precision: which dtype holds the weights, which one computes, and which one rolls out.

Owns :func:`rule_mixed_precision` (a static rule) and :func:`rollout_dtype`. ``model.dtype`` is the
dtype of the trained weights and their AdamW state; ``training.mixed_precision`` (``bf16``/``fp16``)
autocasts the forward and backward passes on top of float32 weights: fp32 master weights, bf16
compute, as HF's ``bf16: true`` on a float32 model and DeepSpeed's bf16 mode do. Pure bf16
(``model.dtype: bfloat16``) loses every update below a weight's bf16 spacing: at lr 1e-6 Adam moves a
weight by about 1e-6, far below the spacing (7.8e-5) of a weight of 0.02
(tests/training/test_precision.py shows both on a tiny model).

Leaves out: the HF arguments themselves (``config.hf_args``) and the engines (``rollout``, ``server``).
"""

from __future__ import annotations

from rollmatch.config.schema import RollmatchConfig
from rollmatch.errors import ConfigProblem

_COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def rule_mixed_precision(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`training.mixed_precision` bf16 / fp16 needs `model.dtype: float32` (the master weights it keeps)."""
    mixed = cfg.training.mixed_precision
    if mixed == "no" or cfg.model.dtype == "float32":
        return []
    return [
        ConfigProblem(
            "training.mixed_precision",
            mixed,
            f"mixed precision keeps float32 master weights, but model.dtype is {cfg.model.dtype}: set "
            f"model.dtype: float32 (fp32 weights, {mixed} compute), or mixed_precision: no for pure {cfg.model.dtype}",
        )
    ]


def rollout_dtype(cfg: RollmatchConfig) -> str:
    """The dtype rollout engines run on a GPU: the compute dtype under mixed precision, else model.dtype."""
    return _COMPUTE_DTYPES.get(cfg.training.mixed_precision, cfg.model.dtype)
