"""LLMEasyQuant: quantize large language models into real integer layers and measure what it cost and bought."""

from __future__ import annotations

from llmeasyquant.api import quantize
from llmeasyquant.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    LLMEasyQuantError,
    ModelLoadError,
    OutputExistsError,
)
from llmeasyquant.eval.export_check import check_export
from llmeasyquant.export.checkpoint import load, save
from llmeasyquant.export.formats import export
from llmeasyquant.jobs.compare import CompareSpec, compare
from llmeasyquant.jobs.evaluate import evaluate
from llmeasyquant.methods import AWQ, GPTAQ, GPTQ, RTN, Rotate, SmoothQuant, ZeroQuant
from llmeasyquant.methods.simquant import SimQuant
from llmeasyquant.models.load import load_model
from llmeasyquant.nn.fused import fuse_shared_inputs
from llmeasyquant.nn.kv.cache import KVCacheSpec, QuantizedKVCache
from llmeasyquant.nn.kv.config import KVQuantConfig
from llmeasyquant.nn.placement import place_on_huge_pages
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.plan import Plan, Rule
from llmeasyquant.record import Record, read_records, write_records
from llmeasyquant.runtime.decoder import LeanDecoder
from llmeasyquant.scheme import (
    W4A8_G128,
    W4A16_G64,
    W4A16_G128,
    W8A8,
    W8A16,
    ActMode,
    ActScheme,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    QuantScheme,
    make_scheme,
    parse_scheme,
)
from llmeasyquant.search import Budget, MixedPrecisionSearch
from llmeasyquant.version import __version__

__all__ = [
    "AWQ",
    "GPTAQ",
    "GPTQ",
    "RTN",
    "W4A8_G128",
    "W4A16_G64",
    "W4A16_G128",
    "W8A8",
    "W8A16",
    "ActMode",
    "ActScheme",
    "Budget",
    "CheckpointError",
    "CompareSpec",
    "ConfigError",
    "DataError",
    "KVCacheSpec",
    "KVQuantConfig",
    "LLMEasyQuantError",
    "LeanDecoder",
    "MixedPrecisionSearch",
    "ModelLoadError",
    "OutputExistsError",
    "PerChannel",
    "PerGroup",
    "PerTensor",
    "PerToken",
    "Plan",
    "QuantLinear",
    "QuantScheme",
    "QuantizedKVCache",
    "Record",
    "Rotate",
    "Rule",
    "SimQuant",
    "SmoothQuant",
    "ZeroQuant",
    "__version__",
    "check_export",
    "compare",
    "evaluate",
    "export",
    "fuse_shared_inputs",
    "load",
    "load_model",
    "make_scheme",
    "parse_scheme",
    "place_on_huge_pages",
    "quantize",
    "read_records",
    "save",
    "write_records",
]
