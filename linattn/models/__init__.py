"""Pretrained models with their attention replaced: the real-model accuracy benchmark.

:mod:`linattn.models.bert` is a NumPy BERT encoder whose attention is a callable;
:mod:`linattn.models.minilm` loads all-MiniLM-L6-v2 (weights checked by SHA-256);
:mod:`linattn.models.accuracy` measures how far each estimator moves the model.
Reading the weights needs ``safetensors`` and ``tokenizers``; nothing here is imported
by ``linattn`` itself.
"""

from linattn.models.bert import Attention, BertConfig, BertEncoder, exact_attention
from linattn.models.minilm import (
    INSTALL_HINT,
    MINILM_SHA256,
    ModelUnavailable,
    SentenceModel,
    load_model,
    resolve_model_path,
)

__all__ = [
    "INSTALL_HINT",
    "MINILM_SHA256",
    "Attention",
    "BertConfig",
    "BertEncoder",
    "ModelUnavailable",
    "SentenceModel",
    "exact_attention",
    "load_model",
    "resolve_model_path",
]
