"""Options that several `llmeasyquant` subcommands share: evaluation, scheme, calibration and KV cache."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from llmeasyquant.errors import ConfigError
from llmeasyquant.runtime.requests import MAX_STOPS
from llmeasyquant.scheme import GRIDS, ActMode

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmeasyquant.runtime.engine import Engine, EngineConfig
    from llmeasyquant.runtime.requests import SamplingParams

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_SCHEMES = "w8a16,w8a8,w8a8-aasym,w4a16-g64-asym,w4a16-g128-asym"  # compare's rows without --methods
METHOD_HELP = ("rtn, gptq, gptaq (GPTQ fitted to the unquantized model's outputs), awq, smoothquant, zeroquant, rotate "
               "(a rotation of the residual stream, first), or a recipe such as awq+gptq, smoothquant+gptq or "
               "rotate+gptq (default rtn)")


def add_eval_options(p: argparse.ArgumentParser, max_windows: int | None) -> None:
    p.add_argument("--text", help="evaluation text: 'wikitext2' (the shipped WikiText-2 raw test split; the default), "
                   "'pyref' (shipped Python Language Reference topics, a second domain), a file, "
                   "'hub:DATASET[:CONFIG]' (its test split, needs the 'hub' extra and a network) or 'self' "
                   "(text the unquantized model generates; its figures say so)")
    p.add_argument("--seqlen", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--max-windows", type=int, default=max_windows,
                   help=f"evaluate the first N windows (default {max_windows or 'all'})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the result record(s) to this JSON file")


def add_scheme_options(p: argparse.ArgumentParser) -> None:
    from llmeasyquant.presets import QUANTIZE_PRESETS

    p.add_argument("--preset", choices=tuple(QUANTIZE_PRESETS), help="the recipe measured best for a bit budget "
                   "(docs/methods.md, 'Presets'), calibrated on --calib (default wikitext2): " + "; ".join(
                       f"{p.name}: {p.options} ({p.measured})" for p in QUANTIZE_PRESETS.values()).replace("%", "%%")
                   + ". Replaces --method and the scheme options")  # %%: argparse formats help strings
    p.add_argument("--method", help=METHOD_HELP)
    p.add_argument("--bits", type=int, help="weight bits: 2, 3, 4 or 8 (default 8). With none of --bits, "
                   "--group-size, --asym, --act-bits, --act-mode the method's own scheme is used: rtn w8a16, gptq "
                   "w4a16-g128, awq w4a16-g128-asym, smoothquant w8a8, zeroquant w4a8-g64")
    p.add_argument("--group-size", type=int, help="weights per scale along the input dimension (default: per channel)")
    p.add_argument("--asym", action="store_true", help="asymmetric (zero-point) weights instead of symmetric (AbsMax)")
    p.add_argument("--grid", choices=GRIDS,
                   help="a non-uniform grid, weight = table[code] x scale (symmetric, one fp16 scale per group): with "
                   "--bits 4 'nf4' NormalFloat levels, 'iq4nl' llama.cpp's IQ4_NL table (exported to GGUF IQ4_NL "
                   "exactly); 'learned' a table per row fitted to the weights, 16 levels with --bits 4 or 8 with "
                   "--bits 3 (default: uniform codes)")
    p.add_argument("--act-bits", type=int, choices=(4, 8, 16),
                   help="8: dynamic per-token int8 activations (W8A8, W4A8 on integer kernels); 4: 4-bit ones (W4A4: "
                   "with a rotation, --method rotate+gptq); 16: float activations")
    p.add_argument("--act-clip", type=_clip, default=1.0, metavar="FRACTION|search",
                   help="dynamic activation scales cover this fraction of each token's range, values beyond it "
                   "saturate (default 1: no clipping). 0.9 lowers 4-bit activations' rounding error (W4A4); "
                   "'search' picks each token's fraction (1 to 0.5) by least rounding error at run time")
    p.add_argument("--act-asym", action="store_true",
                   help="asymmetric activations: a zero point per token (dynamic) or per layer (static, online), "
                   "so that a skewed range uses every level (scheme suffix -aasym)")
    p.add_argument("--act-sinks", type=int, default=0, metavar="N",
                   help="with --act-bits 4: the first N tokens of each sequence (the attention sink) take 8-bit "
                   "activations (default 0). 1 is enough for SmolLM2, whose first token carries its massive "
                   "activations")
    p.add_argument("--act-group-size", type=int, default=None, metavar="N",
                   help="dynamic activation scales per token per N channels instead of one per token (N must "
                   "equal --group-size: the integer kernel scales each group's sum by both scales; scheme suffix "
                   "-agN). At 4 bits each group rounds on its own range: SmolLM2 at W4A4, +44.9%% perplexity "
                   "against +62.4%% with one scale a token (docs/methods.md, 'Activation groups')")
    p.add_argument("--act-mode", choices=[mode.value for mode in ActMode],
                   help="with --act-bits 8: 'dynamic' per-token scales computed on the fly (default); 'static' one "
                   "per-tensor scale per layer from calibration data; 'online' a per-tensor range tracked with an "
                   "exponential moving average while the model runs, no calibration")
    p.add_argument("--static", action="store_true", help="same as --act-mode static")
    p.add_argument("--act-momentum", type=float, default=0.9,
                   help="online mode: EMA momentum α of the tracked range (default 0.9)")
    p.add_argument("--act-eps", type=float, default=1e-5,
                   help="online mode: smallest range ε_0 an observation may set (default 1e-5)")
    p.add_argument("--act-std-floor", action="store_true",
                   help="online mode: raise each observation's range to at least its standard deviation")
    p.add_argument("--lm-head", metavar="SCHEME",
                   help="also quantize the LM head with this scheme: weight-only (e.g. w8a16) or with dynamic "
                   "activations (e.g. w8a8, w4a8-g128: integer kernels); default: kept in float; a tied head gets its "
                   "own integer copy. It is the largest matrix read per decoded token")
    p.add_argument("--plan", type=Path, help="a plan JSON (per-layer schemes) instead of --bits/--group-size/--asym")
    p.add_argument("--keep-fp32", action="store_true",
                   help="store unquantized tensors (embeddings, norms, biases) in fp32 instead of fp16")
    add_calibration_options(p)


def add_calib_text_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calib", help="calibration text for methods that need it: 'wikitext2' (the shipped WikiText-2 "
                   "validation split), 'pyref' (the other half of the Python reference topics), a file, "
                   "'hub:DATASET[:CONFIG]' (its validation split) or 'self' (text the model generates)")
    p.add_argument("--calib-samples", type=int, default=64, help="calibration samples (default 64)")
    p.add_argument("--calib-seqlen", type=int, default=512, help="tokens per calibration sample (default 512)")


def add_kv_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-bits", type=int, help="quantize the KV cache (SimQuant): 2, 3, 4 or 8 bits for keys and "
                   "values; key ranges from --calib text, or tracked online without it")
    p.add_argument("--kv-outliers", type=float,
                   help="share of each value vector (and of each key vector with --kv-key-block 0) kept apart in "
                   "fp16 (default 0.01; 0.047 at 3 bits)")
    p.add_argument("--kv-key-block", type=int,
                   help="keys are coded per block of this many positions, each channel on the block's own range "
                   "(default 32; 16 at 3 bits); 0 codes each key on arrival on the calibrated range, as KVQuant")
    p.add_argument("--kv-sinks", type=int, default=8, help="first tokens kept unquantized, in 16 bits (default 8)")
    p.add_argument("--kv-key-channels", type=int,
                   help="per head, the most sensitive key channels (calibrated) kept in fp16 (default 0; 2 at 3 bits)")
    p.add_argument("--kv-levels", choices=("uniform", "nf"), default="uniform",
                   help="uniform levels, or NF-style levels at normal quantiles (default uniform)")
    p.add_argument("--kv-compact", action="store_true",
                   help="side information in fewer bytes: key block ends in 6 bits, the key channels of "
                   "--kv-key-channels in 8-bit codes, value outliers in 8 bits, value ranges searched (needs key "
                   "blocks; docs/methods.md)")


def add_calibration_options(p: argparse.ArgumentParser) -> None:
    add_calib_text_options(p)
    add_kv_options(p)
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ: quantize columns by decreasing Hessian diagonal (default: on)")
    p.add_argument("--true-sequential", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ: solve each group of layers that read one input (q/k/v, o, gate/up, down) on a new pass "
                   "over the block with the groups before it quantized (one pass per group; default: off)")
    p.add_argument("--alpha", type=_alpha, help="SmoothQuant migration strength in [0, 1], or 'auto' to search it "
                   "per block on the block's output error (default 0.5)")
    p.add_argument("--lkd", action=argparse.BooleanOptionalAction, default=None,
                   help="ZeroQuant: layer-by-layer distillation (default: on)")
    p.add_argument("--lkd-steps", type=int, help="ZeroQuant: Adam steps per block (default 50)")
    p.add_argument("--lkd-lr", type=float, help="ZeroQuant: learning rate (default 5e-5)")
    p.add_argument("--lkd-samples", type=int, help="ZeroQuant: calibration samples to distil on (default: all)")
    p.add_argument("--lkd-inputs", choices=("float", "quantized"),
                   help="ZeroQuant: distil on the unquantized model's activations (default, the paper) or the "
                   "quantized model's")
    p.add_argument("--rotation-seed", type=int,
                   help="rotate: the seed of the residual stream's rotation (default 0; see docs/methods.md)")
    p.add_argument("--online-rotation", action=argparse.BooleanOptionalAction, default=None,
                   help="rotate: also an online Hadamard transform of each down-projection's input, applied at run "
                   "time by the quantized layer (default: off; our checkpoint keeps it, GGUF, ONNX and "
                   "compressed-tensors exports refuse it; see docs/methods.md)")
    p.add_argument("--online-attention-rotation", action=argparse.BooleanOptionalAction, default=None,
                   help="rotate: also an online Hadamard transform of each attention output projection's input (the "
                   "heads' outputs), as --online-rotation does for the down projection (default: off; for 4-bit "
                   "activations)")


def _number_or(word: str, interval: str) -> Callable[[str], float | str]:
    """An argparse type for an option that takes a number in `interval` or the word `word` (checked further on)."""

    def parse(text: str) -> float | str:
        if text.strip().lower() == word:
            return word
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in {interval} or '{word}', got {text!r}") from None

    return parse


_clip = _number_or("search", "(0, 1]")
_alpha = _number_or("auto", "[0, 1]")


# generate, chat and serve -------------------------------------------------------------------------------------------


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The serving engine's options (runtime/engine.py's EngineConfig), shared by generate, chat and serve."""
    from llmeasyquant.runtime.engine import EngineConfig

    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--kv-bits", type=int, choices=(2, 3, 4, 8), help="store the KV cache as SimQuant codes of this "
                   "many bits (default: a float cache in --kv-dtype, or the quantized cache a checkpoint carries)")
    g.add_argument("--kv-memory", type=float, default=d.kv_memory_mb, metavar="MB", help="memory for the KV cache "
                   f"of all running sequences, MiB (default {d.kv_memory_mb:g}); a request is admitted when its "
                   "prompt and max tokens fit")
    g.add_argument("--kv-dtype", choices=("float16", "float32"), default=d.kv_dtype,
                   help=f"storage of a float KV cache (default {d.kv_dtype})")
    g.add_argument("--max-running", type=int, default=d.max_running, metavar="N",
                   help=f"sequences decoded together at most (default {d.max_running})")
    g.add_argument("--max-queue", type=int, default=d.max_queue, metavar="N",
                   help=f"requests waiting for a slot at most; more are refused (default {d.max_queue})")
    g.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk, metavar="N",
                   help="prompt tokens prefilled per step over all requests; longer prompts run in chunks of "
                   "this many, so running streams wait at most one chunk's work (default "
                   f"{d.prefill_chunk}, llama-server's batch size)")
    g.add_argument("--max-context", type=int, metavar="N", help="prompt plus completion tokens per request at most "
                   "(default: the model's positions, at most 4096)")


# The engine names its fields; the user typed options.
_ENGINE_OPTIONS = {"max_running": "--max-running", "max_queue": "--max-queue", "prefill_chunk": "--prefill-chunk",
                   "max_context": "--max-context", "the KV memory": "--kv-memory"}


def _named_option(exc: ConfigError) -> ConfigError:
    text = str(exc)
    for field, option in _ENGINE_OPTIONS.items():
        text = text.replace(field, option)
    return ConfigError(text)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine options ask for; a value out of range is a ConfigError naming its option."""
    from llmeasyquant.runtime.engine import EngineConfig

    try:
        return EngineConfig(kv_memory_mb=args.kv_memory, kv_bits=args.kv_bits, kv_dtype=args.kv_dtype,
                            max_running=args.max_running, max_queue=args.max_queue,
                            prefill_chunk=args.prefill_chunk, max_context=args.max_context,
                            seed=args.seed if args.seed is not None else 0)
    except ConfigError as exc:
        raise _named_option(exc) from None


def served_model_name(spec: str) -> str:
    """A model's name in responses: the folder's name for a checkpoint or model folder, else the spec itself."""
    path = Path(spec)
    return path.resolve().name if path.is_dir() else spec


def load_engine(args: argparse.Namespace, name: str | None = None) -> Engine:
    """The engine over args.model with the engine options, its decode thread started."""
    from llmeasyquant.runtime.engine import Engine

    config = engine_config(args)
    try:
        engine = Engine.load(args.model, config, name or served_model_name(args.model))
    except ConfigError as exc:  # e.g. --max-context past the model's positions
        raise _named_option(exc) from None
    engine.start()
    return engine


def add_sampling_options(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """How generate and chat decode: greedy by default, so a prompt gives the same text on every run."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help=f"tokens generated at most (default {max_new_tokens})")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature in [0, 2]; 0 is greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens holding "
                   "this probability, in (0, 1] (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: off)")
    p.add_argument("--seed", type=int, help="seed of the sampling, for the same text again (default 0)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help=f"end the reply where this text appears (not shown); repeatable, up to {MAX_STOPS}")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                   help="subtract P from the logit of every token the reply holds already, in [-2, 2] (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="subtract F times the number of times a token appears in the reply so far from its "
                   "logit, in [-2, 2] (default 0)")


def sampling_params(args: argparse.Namespace, max_tokens: int | None = None) -> SamplingParams:
    """SamplingParams from the sampling options; a value out of range is an error naming its option."""
    from llmeasyquant.runtime.requests import RequestError, SamplingParams

    params = SamplingParams(max_tokens=args.max_new_tokens if max_tokens is None else max_tokens,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=tuple(args.stop), ignore_eos=args.ignore_eos,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
    try:
        params.check()
    except RequestError as exc:
        option = {"max_tokens": "--max-new-tokens"}.get(exc.param or "", f"--{(exc.param or '').replace('_', '-')}")
        raise ConfigError(f"{option}: {exc}") from None
    return params
